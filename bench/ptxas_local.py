"""Registers and spills of kernels cubecl logged, on this machine, without a GPU.

`bench/diag_attention_sass.sh` saves the CUDA source cubecl generated for each register
kernel (`logs/mma_*.cu`). This compiles such a source the way cubecl does on the device
(NVRTC, for compute_90) and runs ptxas for sm_90 on the PTX, printing what ptxas reports
(registers, stack, spill stores and loads) and the number of `mma` instructions. NVRTC, ptxas
and the headers come from NVIDIA's pip wheels, downloaded once into ~/.cache/nvidia-wheels.

    python3 bench/ptxas_local.py logs/mma_forward-1.cu [more.cu ...]
"""
import ctypes
import os
import pathlib
import subprocess
import sys
import zipfile

CACHE = pathlib.Path.home() / ".cache" / "nvidia-wheels"
WHEELS = ["nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-cccl-cu12",
          "nvidia-cuda-runtime-cu12"]


def toolkit() -> pathlib.Path:
    """The unpacked wheels' root (nvidia/...), fetched on first use."""
    root = CACHE / "x"
    if not (root / "nvidia" / "cuda_nvrtc").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(CACHE), *WHEELS], check=True)
        for wheel in CACHE.glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(root)
        os.chmod(root / "nvidia" / "cuda_nvcc" / "bin" / "ptxas", 0o755)
    return root / "nvidia"


def ptx_of(source: bytes, nv: pathlib.Path) -> bytes:
    """NVRTC's PTX for `source` (exits with NVRTC's log when it does not compile)."""
    lib = ctypes.CDLL(str(nv / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"k.cu", 0, None, None) == 0
    includes = [nv / "cuda_runtime" / "include", nv / "cuda_cccl" / "include",
                nv / "cuda_nvcc" / "include"]
    opts = [b"--gpu-architecture=compute_90", b"-std=c++17", b"-default-device"]
    opts += [f"-I{i}".encode() for i in includes]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if rc != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode()[-4000:])
    size = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main() -> None:
    nv = toolkit()
    ptxas = nv / "cuda_nvcc" / "bin" / "ptxas"
    for path in sys.argv[1:]:
        ptx = ptx_of(pathlib.Path(path).read_bytes(), nv)
        out = pathlib.Path("/tmp") / (pathlib.Path(path).stem + ".ptx")
        out.write_bytes(ptx)
        report = subprocess.run([str(ptxas), "-arch=sm_90", "-O3", "-v", str(out), "-o",
                                 str(out.with_suffix(".cubin"))], capture_output=True,
                                text=True)
        lines = [l.split("info    : ")[-1].strip() for l in report.stderr.splitlines()
                 if "registers" in l or "spill" in l]
        print(f"{path}: {ptx.count(b'mma.sync')} mma; " + "; ".join(lines))


if __name__ == "__main__":
    main()
