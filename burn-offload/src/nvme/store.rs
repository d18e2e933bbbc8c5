//! The swap store: sub-groups in aligned regions of one file per tensor, read and written by an I/O
//! thread.

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use super::disk::{ALIGN, AlignedBuf, check_room, checksum, open_swap};

/// Why the swap failed.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// A file operation failed.
    #[error("{path}: {what}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        what: String,
    },
    /// A region read back differs from what was written.
    #[error(
        "swap file {path} is corrupted: sub-group {group} (bytes {offset}..{end}) differs from what was written"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The sub-group.
        group: usize,
        /// Its first byte.
        offset: u64,
        /// One past its last byte.
        end: u64,
    },
    /// The step visiting the files stopped because another stage of it failed.
    #[error("the step was abandoned: another stage of it failed")]
    Abandoned,
}

pub(super) fn io_err(path: &Path, what: impl std::fmt::Display) -> SwapError {
    SwapError::Io {
        path: path.to_path_buf(),
        what: what.to_string(),
    }
}

/// How the swap does its I/O (the config's `aio` section and `buffer_count`).
#[derive(Clone, Debug, PartialEq)]
pub struct SwapConfig {
    /// The user's `nvme_path`: must exist and be writable.
    pub root: PathBuf,
    /// Directory the swap files go in (created inside `root`).
    pub dir: PathBuf,
    /// Bytes per I/O request.
    pub block_size: usize,
    /// Requests in flight at once.
    pub queue_depth: u32,
    /// Sub-groups held in memory at once (at least 3: one stepping, one reading, one writing).
    pub buffer_count: usize,
}

/// What [`NvmeStore::visit`] calls for each sub-group: its index, its element range, its
/// tensors' buffers.
pub type GroupVisitor<'a> =
    dyn FnMut(usize, Range<usize>, &mut [AlignedBuf]) -> Result<(), SwapError> + 'a;

/// One sub-group's tensors in memory.
pub struct Group {
    /// The sub-group's index.
    pub index: usize,
    /// One buffer per swapped tensor, in the store's order.
    pub tensors: Vec<AlignedBuf>,
}

enum Request {
    Read(Group),
    Write(Group),
}

/// A finished request: the buffers always come back, with the failure if any.
enum Done {
    Read(Group, Option<SwapError>),
    Write(Group, Option<SwapError>),
}

/// The files of one partition's swapped tensors and the thread that moves them.
pub struct NvmeStore {
    paths: Vec<PathBuf>,
    groups: Vec<Range<usize>>,
    to_io: Option<Sender<Request>>,
    from_io: Receiver<Done>,
    io: Option<JoinHandle<()>>,
    spare: Vec<Group>,
    /// Whether the files bypass the page cache (O_DIRECT).
    pub direct: bool,
}

/// The byte range of sub-group `g` in every file (regions are `stride` bytes apart).
fn region(g: usize, stride: usize) -> Range<u64> {
    (g * stride) as u64..((g + 1) * stride) as u64
}

struct IoThread {
    files: Vec<(PathBuf, File)>,
    stride: usize,
    block: usize,
    depth: u32,
    sums: Vec<Vec<Option<u64>>>,
}

impl IoThread {
    fn run(mut self, requests: Receiver<Request>, done: Sender<Done>) {
        let mut ring = match io_uring::IoUring::new(self.depth.max(1)) {
            Ok(r) => r,
            Err(e) => {
                let fail = || Some(io_err(Path::new("io_uring_setup"), &e));
                for request in requests {
                    let reply = match request {
                        Request::Read(g) => Done::Read(g, fail()),
                        Request::Write(g) => Done::Write(g, fail()),
                    };
                    let _ = done.send(reply);
                }
                return;
            }
        };
        for request in requests {
            let reply = match request {
                Request::Read(mut g) => {
                    let failed = self.transfer(&mut ring, &mut g, false).err();
                    Done::Read(g, failed)
                }
                Request::Write(mut g) => {
                    let failed = self.transfer(&mut ring, &mut g, true).err();
                    Done::Write(g, failed)
                }
            };
            if done.send(reply).is_err() {
                return;
            }
        }
    }

    /// Reads or writes every tensor's region of `g`, `block` bytes per request.
    fn transfer(
        &mut self,
        ring: &mut io_uring::IoUring,
        g: &mut Group,
        write: bool,
    ) -> Result<(), SwapError> {
        let base = region(g.index, self.stride).start;
        for (t, buf) in g.tensors.iter_mut().enumerate() {
            let (path, file) = &self.files[t];
            let fd = io_uring::types::Fd(file.as_raw_fd());
            if write {
                self.sums[t][g.index] = Some(checksum(buf.region()));
            }
            let ptr = buf.ptr as *mut u8;
            let requests: Vec<(usize, usize)> = (0..buf.bytes)
                .step_by(self.block)
                .map(|s| (s, (s + self.block).min(buf.bytes) - s))
                .collect();
            let mut pending: VecDeque<(usize, usize)> = requests.into();
            let mut in_flight = 0usize;
            let mut failure: Option<String> = None;
            // On a failure, stop submitting but collect what is in flight: the kernel holds
            // pointers into the buffer until then.
            while (failure.is_none() && !pending.is_empty()) || in_flight > 0 {
                while failure.is_none()
                    && in_flight < self.depth as usize
                    && let Some((at, len)) = pending.pop_front()
                {
                    if write && super::fault::disk_full(path, len as u64) {
                        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC);
                        failure = Some(enospc.to_string());
                        break;
                    }
                    let offset = base + at as u64;
                    // SAFETY: `ptr + at .. + len` lies inside the buffer, which outlives the
                    // request (every completion is collected before returning).
                    let entry = if write {
                        io_uring::opcode::Write::new(fd, unsafe { ptr.add(at) }, len as u32)
                            .offset(offset)
                            .build()
                    } else {
                        io_uring::opcode::Read::new(fd, unsafe { ptr.add(at) }, len as u32)
                            .offset(offset)
                            .build()
                    };
                    let entry = entry.user_data(len as u64);
                    // SAFETY: the entry's buffer stays valid until its completion (above).
                    match unsafe { ring.submission().push(&entry) } {
                        Ok(()) => in_flight += 1,
                        Err(e) => failure = Some(format!("io_uring queue: {e}")),
                    }
                }
                if in_flight == 0 {
                    break;
                }
                ring.submit_and_wait(1).map_err(|e| io_err(path, e))?;
                let done: Vec<(i32, i32)> = ring
                    .completion()
                    .map(|c| (c.result(), c.user_data() as i32))
                    .collect();
                for (res, want) in done {
                    in_flight -= 1;
                    if res != want && failure.is_none() {
                        failure = Some(if res < 0 {
                            std::io::Error::from_raw_os_error(-res).to_string()
                        } else {
                            let op = if write { "write" } else { "read" };
                            format!("short {op} ({res} of {want} bytes)")
                        });
                    }
                }
            }
            if let Some(what) = failure {
                return Err(io_err(path, what));
            }
            if !write && self.sums[t][g.index].is_some_and(|s| s != checksum(buf.region())) {
                let r = region(g.index, self.stride);
                return Err(SwapError::Corrupt {
                    path: path.clone(),
                    group: g.index,
                    offset: r.start,
                    end: r.end,
                });
            }
        }
        Ok(())
    }
}

impl NvmeStore {
    /// Swap files for tensors `names` of a partition of `len` elements in sub-groups of
    /// `sub_group` elements, under `config.dir` (created), each file written from `initial`
    /// (the tensor's index and the sub-group's range → its values; zeros when `None`).
    /// Checks first that the directory is writable and has room, naming the problem.
    pub fn create(
        config: &SwapConfig,
        names: &[&str],
        len: usize,
        sub_group: usize,
        initial: &dyn Fn(usize, Range<usize>) -> Option<Vec<f32>>,
    ) -> Result<Self, SwapError> {
        let sub_group = sub_group.clamp(1, len.max(1));
        let groups: Vec<Range<usize>> = (0..len)
            .step_by(sub_group)
            .map(|s| s..(s + sub_group).min(len))
            .collect();
        let stride = (sub_group * 4).next_multiple_of(ALIGN);
        let needed = (stride * groups.len() * names.len()) as u64;
        check_room(&config.root, &config.dir, needed)?;
        let mut direct = true;
        let mut files = Vec::new();
        for name in names {
            let path = config.dir.join(format!("{name}.swp"));
            let (file, is_direct) = open_swap(&path)?;
            direct &= is_direct;
            file.set_len(needed / names.len() as u64)
                .map_err(|e| io_err(&path, e))?;
            files.push((path, file));
        }
        let paths = files.iter().map(|(p, _)| p.clone()).collect();
        let (to_io, requests) = channel();
        let (replies, from_io) = channel();
        let io = IoThread {
            files,
            stride,
            block: config.block_size.next_multiple_of(ALIGN).max(ALIGN),
            depth: config.queue_depth.max(1),
            sums: vec![vec![None; groups.len()]; names.len()],
        };
        let handle = std::thread::Builder::new()
            .name("burn-zero-swap".into())
            .spawn(move || io.run(requests, replies))
            .map_err(|e| io_err(&config.dir, e))?;
        let spare = (0..config.buffer_count.max(3))
            .map(|_| Group {
                index: 0,
                tensors: names.iter().map(|_| AlignedBuf::new(sub_group)).collect(),
            })
            .collect();
        let mut store = Self {
            paths,
            groups,
            to_io: Some(to_io),
            from_io,
            io: Some(handle),
            spare,
            direct,
        };
        store.fill(names.len(), initial)?;
        Ok(store)
    }

    /// The swap files, one per tensor.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    fn send(&self, request: Request) {
        self.to_io
            .as_ref()
            .expect("the I/O thread runs until drop")
            .send(request)
            .expect("the swap's I/O thread is alive");
    }

    /// Writes every sub-group from `initial`.
    fn fill(
        &mut self,
        tensors: usize,
        initial: &dyn Fn(usize, Range<usize>) -> Option<Vec<f32>>,
    ) -> Result<(), SwapError> {
        self.visit(false, true, &mut |_, range, bufs| {
            for (t, buf) in bufs.iter_mut().enumerate().take(tensors) {
                let values = buf.as_mut_slice();
                values.fill(0.0);
                if let Some(v) = initial(t, range.clone()) {
                    values[..v.len()].copy_from_slice(&v);
                }
            }
            Ok(())
        })
    }

    /// Calls `f(g, range, tensors)` for every sub-group in order, with the sub-group's tensors
    /// in memory (read from the files when `read`, else stale buffers to overwrite), and writes
    /// them back after `f` when `write`. Reads of the next sub-groups and writes of the last
    /// overlap `f`.
    pub fn visit(
        &mut self,
        read: bool,
        write: bool,
        f: &mut GroupVisitor<'_>,
    ) -> Result<(), SwapError> {
        self.visit_groups(read, write, 0..self.groups.len(), f)
    }

    /// Elements `range` of tensor `t`, read from the sub-groups that hold them (checked).
    pub fn read_range(&mut self, t: usize, range: Range<usize>) -> Result<Vec<f32>, SwapError> {
        let first = self.groups.partition_point(|g| g.end <= range.start);
        let last = self.groups.partition_point(|g| g.start < range.end);
        let mut out = Vec::with_capacity(range.len());
        self.visit_groups(true, false, first..last, &mut |_, group, bufs| {
            let (start, end) = (range.start.max(group.start), range.end.min(group.end));
            out.extend_from_slice(&bufs[t].as_slice()[start - group.start..end - group.start]);
            Ok(())
        })?;
        Ok(out)
    }

    /// [`NvmeStore::visit`] over the sub-groups `groups` only.
    fn visit_groups(
        &mut self,
        read: bool,
        write: bool,
        groups: Range<usize>,
        f: &mut GroupVisitor<'_>,
    ) -> Result<(), SwapError> {
        let n = groups.end.min(self.groups.len());
        let mut next_read = groups.start;
        let mut ready: VecDeque<Group> = VecDeque::new();
        let mut writes_out = 0;
        let mut reads_out = 0;
        let mut failure = None;
        let start_reads = |store: &mut Self,
                           next_read: &mut usize,
                           reads_out: &mut usize,
                           ready: &mut VecDeque<Group>| {
            // Keep one spare for the write of the group being stepped.
            while *next_read < n && store.spare.len() > 1 {
                let mut g = store.spare.pop().expect("a spare buffer");
                g.index = *next_read;
                *next_read += 1;
                if read {
                    store.send(Request::Read(g));
                    *reads_out += 1;
                } else {
                    ready.push_back(g);
                }
            }
        };
        for index in groups.start..n {
            start_reads(self, &mut next_read, &mut reads_out, &mut ready);
            // Wait for this group's read (completions arrive in request order).
            while ready.front().is_none_or(|g| g.index != index) {
                match self.from_io.recv().expect("the swap's I/O thread is alive") {
                    Done::Read(g, None) => {
                        reads_out -= 1;
                        ready.push_back(g);
                    }
                    Done::Write(g, None) => {
                        writes_out -= 1;
                        self.spare.push(g);
                        start_reads(self, &mut next_read, &mut reads_out, &mut ready);
                    }
                    Done::Read(g, Some(e)) => {
                        reads_out -= 1;
                        self.spare.push(g);
                        failure = Some(e);
                        break;
                    }
                    Done::Write(g, Some(e)) => {
                        writes_out -= 1;
                        self.spare.push(g);
                        failure = Some(e);
                        break;
                    }
                }
            }
            if failure.is_some() {
                break;
            }
            let mut g = ready.pop_front().expect("the group just read");
            if let Err(e) = f(index, self.groups[index].clone(), &mut g.tensors) {
                failure = Some(e);
                self.spare.push(g);
                break;
            }
            if write {
                self.send(Request::Write(g));
                writes_out += 1;
            } else {
                self.spare.push(g);
            }
        }
        // Collect everything in flight, so every buffer is back before returning.
        while reads_out + writes_out > 0 {
            let (g, failed) = match self.from_io.recv().expect("the swap's I/O thread is alive") {
                Done::Read(g, failed) => {
                    reads_out -= 1;
                    (g, failed)
                }
                Done::Write(g, failed) => {
                    writes_out -= 1;
                    (g, failed)
                }
            };
            self.spare.push(g);
            failure = failure.or(failed);
        }
        self.spare.extend(ready);
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Tensor `t` read whole.
    pub fn read_all(&mut self, t: usize) -> Result<Vec<f32>, SwapError> {
        let mut out = Vec::with_capacity(self.groups.last().map_or(0, |r| r.end));
        self.visit(true, false, &mut |_, range, bufs| {
            out.extend_from_slice(&bufs[t].as_slice()[..range.len()]);
            Ok(())
        })?;
        Ok(out)
    }

    /// Replaces every tensor with `values` (one full-length vector per tensor).
    pub fn write_all(&mut self, values: &[Vec<f32>]) -> Result<(), SwapError> {
        self.visit(false, true, &mut |_, range, bufs| {
            for (buf, v) in bufs.iter_mut().zip(values) {
                buf.as_mut_slice()[..range.len()].copy_from_slice(&v[range.clone()]);
            }
            Ok(())
        })
    }
}

impl Drop for NvmeStore {
    fn drop(&mut self) {
        drop(self.to_io.take());
        if let Some(io) = self.io.take() {
            let _ = io.join();
        }
        for path in &self.paths {
            let _ = std::fs::remove_file(path);
        }
    }
}
