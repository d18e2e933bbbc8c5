/* GPU activity of a whole process, for a busy fraction without Nsight Systems (issue 37).
 *
 * A CUDA injection library: with CUDA_INJECTION64_PATH=libbusy.so the driver calls
 * InitializeInjection at cuInit, which turns on CUPTI's activity records for kernels, copies and
 * memsets. At exit the records go to $BUSY_OUT_DIR/busy-<pid>.csv in the columns of
 * `nsys stats --report cuda_gpu_trace` that bench/nsys_busy.py reads ("Start (ns)",
 * "Duration (ns)"), plus the kind (kernel, memcpy, memset), bytes, stream and kernel name
 * (bench/busy_kernels.py counts them per step). CUPTI is loaded with dlopen
 * from $BUSY_CUPTI_LIB (the device's torch ships one), so this builds with gcc alone:
 *   gcc -O2 -shared -fPIC -o libbusy.so busy.c -ldl -lpthread
 * The record layouts are CUPTI's: every kernel (CUpti_ActivityKernel4..9), memcpy (5, 6) and
 * memset (4) record holds its start and end, in ns, at bytes 16 and 24 (cupti_activity.h of
 * CUDA 12.9), a memcpy or memset its byte count at byte 8 and its stream at 40, a kernel its
 * stream at 48 and its name (a string CUPTI owns) at 104. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { KIND_MEMCPY = 1, KIND_MEMSET = 2, KIND_CONCURRENT_KERNEL = 10 };
enum { BUFFER_BYTES = 8 << 20, ALIGN = 8, FLUSH_FORCED = 1 };

typedef struct { uint32_t kind; } Record;
typedef void (*Requested)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*Completed)(void *context, uint32_t stream, uint8_t *buffer, size_t size,
                          size_t valid);

static int (*register_callbacks)(Requested, Completed);
static int (*enable)(int);
static int (*flush_all)(uint32_t);
static int (*next_record)(uint8_t *, size_t, Record **);

typedef struct { uint64_t start, end, bytes; uint32_t kind, stream, name; } Span;
static Span *spans;
static size_t count, capacity;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int dumped;

/* Kernel names, interned by CUPTI's pointer (one string per function): id i + 1 is names[i]. */
enum { TABLE = 1 << 14 };
static const char *keys[TABLE];
static uint32_t ids[TABLE];
static char **names;
static uint32_t name_count;

static uint32_t intern(const char *name) {
  if (!name) return 0;
  size_t slot = ((uintptr_t)name >> 4) % TABLE;
  for (size_t probe = 0; probe < TABLE; probe++, slot = (slot + 1) % TABLE) {
    if (keys[slot] == name) return ids[slot];
    if (!keys[slot]) {
      char **grown = realloc(names, (name_count + 1) * sizeof(char *));
      if (!grown) return 0;
      names = grown;
      names[name_count] = strdup(name);
      keys[slot] = name;
      ids[slot] = ++name_count;
      return ids[slot];
    }
  }
  return 0;
}

static void requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(ALIGN, BUFFER_BYTES);
  *size = *buffer ? BUFFER_BYTES : 0;
  *max_records = 0;
}

static void completed(void *context, uint32_t stream, uint8_t *buffer, size_t size,
                      size_t valid) {
  (void)context; (void)stream; (void)size;
  Record *record = NULL;
  pthread_mutex_lock(&lock);
  while (next_record(buffer, valid, &record) == 0) {
    uint32_t kind = record->kind;
    if (kind != KIND_MEMCPY && kind != KIND_MEMSET && kind != KIND_CONCURRENT_KERNEL) continue;
    if (count == capacity) {
      capacity = capacity ? 2 * capacity : 1 << 16;
      spans = realloc(spans, capacity * sizeof(Span));
      if (!spans) { count = capacity = 0; break; }
    }
    const uint8_t *raw = (const uint8_t *)record;
    Span s = {0};
    memcpy(&s.start, raw + 16, 8);
    memcpy(&s.end, raw + 24, 8);
    if (kind != KIND_CONCURRENT_KERNEL) {
      memcpy(&s.bytes, raw + 8, 8);
      memcpy(&s.stream, raw + 40, 4);
    } else {
      const char *name;
      memcpy(&s.stream, raw + 48, 4);
      memcpy(&name, raw + 104, sizeof name);
      s.name = intern(name);
    }
    s.kind = kind;
    spans[count++] = s;
  }
  pthread_mutex_unlock(&lock);
  free(buffer);
}

static void dump(void) {
  if (__sync_lock_test_and_set(&dumped, 1)) return;
  flush_all(FLUSH_FORCED);
  pthread_mutex_lock(&lock);
  if (count > 0) {
    const char *dir = getenv("BUSY_OUT_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/busy-%d.csv", dir ? dir : ".", (int)getpid());
    FILE *f = fopen(path, "w");
    if (f) {
      fprintf(f, "Start (ns),Duration (ns),Kind,Bytes,Stream,Name\n");
      for (size_t i = 0; i < count; i++) {
        const char *name = spans[i].kind == KIND_CONCURRENT_KERNEL ? "kernel"
                           : spans[i].kind == KIND_MEMCPY          ? "memcpy"
                                                                   : "memset";
        fprintf(f, "%llu,%llu,%s,%llu,%u,\"", (unsigned long long)spans[i].start,
                (unsigned long long)(spans[i].end - spans[i].start), name,
                (unsigned long long)spans[i].bytes, spans[i].stream);
        /* The name quoted for CSV (templates hold commas; a quote is doubled). */
        for (const char *c = spans[i].name ? names[spans[i].name - 1] : ""; *c; c++) {
          if (*c == '"') fputc('"', f);
          fputc(*c, f);
        }
        fprintf(f, "\"\n");
      }
      fclose(f);
    } else {
      fprintf(stderr, "libbusy: cannot write %s\n", path);
    }
  }
  pthread_mutex_unlock(&lock);
}

int InitializeInjection(void) {
  const char *path = getenv("BUSY_CUPTI_LIB");
  void *cupti = dlopen(path ? path : "libcupti.so", RTLD_NOW | RTLD_GLOBAL);
  if (!cupti) {
    fprintf(stderr, "libbusy: %s\n", dlerror());
    return 0;
  }
  register_callbacks = dlsym(cupti, "cuptiActivityRegisterCallbacks");
  enable = dlsym(cupti, "cuptiActivityEnable");
  flush_all = dlsym(cupti, "cuptiActivityFlushAll");
  next_record = dlsym(cupti, "cuptiActivityGetNextRecord");
  if (!register_callbacks || !enable || !flush_all || !next_record) {
    fprintf(stderr, "libbusy: CUPTI lacks the activity API\n");
    return 0;
  }
  int rc = register_callbacks(requested, completed);
  rc |= enable(KIND_CONCURRENT_KERNEL);
  rc |= enable(KIND_MEMCPY);
  rc |= enable(KIND_MEMSET);
  if (rc != 0) fprintf(stderr, "libbusy: CUPTI refused the activity records (%d)\n", rc);
  atexit(dump);
  return 1;
}
