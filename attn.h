/* attn.h: decode attention on a CUDA GPU over a device mirror of the policy cache (attn.cu).
 * The host keeps the whole KVCache (kv.c) and every policy decision; the mirror holds the lanes' vectors, scales and
 * live lists in device memory, told by kv.c's slot events (KVSlotFn) which slots changed. Per layer and token, q, k
 * and v cross to the device and the attention output (and, when a policy or a hook wants them, the per-head
 * probabilities) comes back; kv_attend_policy then runs the unchanged host policy code.
 * It deliberately does not move matmuls to the GPU, batch sequences, or decide anything a policy decides.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, budget (slots per lane), R (residual slots per lane).
 * Built without nvcc, the functions below are stubs (attn_cuda_usable says why) and the engine runs on the CPU.
 */
#ifndef KVLAB_ATTN_H
#define KVLAB_ATTN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct AttnDevice AttnDevice;

#ifdef KVLAB_CUDA
#define ATTN_CUDA_BUILT 1
/* 1 when this build has CUDA attention and a usable device (it runs this build's sm_90 code or JIT-compiles its PTX):
 * `name` gets the device's name. 0 otherwise, with the reason in `why` (no nvcc at build time, no driver, no device). */
int attn_cuda_usable(char *name, size_t name_len, char *why, size_t why_len);
/* Create the device mirror of cache c (empty or not: live tokens are uploaded) and attach it (c->device, c->on_slot).
 * 0, or -1 + message (out of device memory, a head_dim or GQA group the kernels do not take). */
int attn_dev_attach(KVCache *c, char *err, size_t errlen);
/* Detach and free the mirror (before kv_cache_free). */
void attn_dev_detach(KVCache *c);
/* Steps 3 and 4 for layer l at position t on the device, after kv_append(c, l, t, ...) on the host (whose slot events
 * carried k and v to the mirror): out (n_heads * head_dim) = the attention of q (n_heads * head_dim, before RoPE).
 * The probabilities come back into c->scores when the policy looks at them or want_probs is set (an evaluation hook);
 * then kv_attend_policy runs. Exits with a message on a CUDA error (a device failing mid-run is not recoverable). */
void attn_dev_attend(KVCache *c, float *out, int l, int t, const float *q, int want_probs);
/* Device memory held by the mirror, bytes: the cache (vectors, scales, live lists) and workspace (scores, splits,
 * the upload buffer, the pos=cache rank table). */
size_t attn_dev_cache_bytes(const KVCache *c);
size_t attn_dev_work_bytes(const KVCache *c);
/* "device cuda (NAME): KV ... MiB in device memory + ... MiB workspace", or "device cpu" (for the summary line). */
void attn_dev_describe(const KVCache *c, char *buf, size_t len);
#else
#define ATTN_CUDA_BUILT 0
/* CPU-only build: no device; c->device stays NULL, so callers never reach attend. */
static inline int attn_cuda_usable(char *name, size_t name_len, char *why, size_t why_len) {
    if (name_len) name[0] = 0;
    snprintf(why, why_len, "this build has no CUDA attention (nvcc was not found at build time)");
    return 0;
}
static inline int attn_dev_attach(KVCache *c, char *err, size_t errlen) {
    (void)c; snprintf(err, errlen, "this build has no CUDA attention"); return -1;
}
static inline void attn_dev_detach(KVCache *c) { (void)c; }
static inline void attn_dev_attend(KVCache *c, float *out, int l, int t, const float *q, int want_probs) {
    (void)want_probs; kv_attend_cpu(c, out, l, t, q);
}
static inline size_t attn_dev_cache_bytes(const KVCache *c) { (void)c; return 0; }
static inline size_t attn_dev_work_bytes(const KVCache *c) { (void)c; return 0; }
static inline void attn_dev_describe(const KVCache *c, char *buf, size_t len) { (void)c; snprintf(buf, len, "device cpu"); }
#endif

/* ---- For tests/test_attn.cu and tests/gpu_check.sh (attn.cu compiled as C++ gives the twin without nvcc) ---- */

/* Attach the CPU twin: a mirror in host memory fed by the same slot events and upload, its kernels run as loops. */
int attn_twin_attach(KVCache *c, char *err, size_t errlen);
/* Detach and free whichever mirror c has. */
void attn_mirror_detach(KVCache *c);
/* Step 3 alone on c's mirror (device or twin): out (n_heads, head_dim); probs (n_heads, budget), rank order, or NULL. */
void attn_mirror_attend(KVCache *c, float *out, float *probs, int l, int t, const float *q);
/* 0 when every live entry and stored byte of the mirror equals the host cache's (keys: within key_tol of the vector's
 * largest element when key_tol > 0); else -1 + the first difference. */
int attn_mirror_check_bytes(const KVCache *c, double key_tol, char *err, size_t errlen);
/* 0 when the sentinel bytes after every output buffer of the mirror are intact; else -1 + which. */
int attn_mirror_check_sentinels(const KVCache *c, char *err, size_t errlen);
/* The kernels' encoder and element decoder compiled for the host (checked against kv_encode, kv_decode). */
void attn_encode_twin(uint8_t *dst, KVType ty, const float *x, int head_dim);
float attn_decode_elem_twin(KVType ty, const uint8_t *src, int e, int head_dim);
/* The launch plan: threads per vector and ranks per split for lanes of up to n_max slots. 0, or -1 when the kernels
 * do not take the shape. */
int attn_plan_twin(int head_dim, int group, int n_max, int launch_lanes, int *tps, int *chunk);

/* Decode attention over all lanes of a cache of `shape` filled synthetically with n_tokens tokens per lane of type
 * ty (f16, q8, ...), timed with CUDA events over `repeats` launches with L2 flushed between them (nvcc builds). */
typedef struct {
    double ms_median, ms_min;   /* ms */
    double bytes;               /* bytes of K and V (scales included) read per launch */
    double gbps;                /* bytes / median time, 1e9 bytes per second */
    int chunk, splits, lanes, bad;   /* bad: a NaN output or probabilities not summing to 1 before timing */
} AttnBench;
#ifdef KVLAB_CUDA
int attn_bench(const KVShape *shape, KVType ty, int n_tokens, int repeats, AttnBench *r, char *err, size_t errlen);
/* Device-to-device copy of `bytes`: (bytes read + bytes written) / median time. */
int attn_bench_copy(size_t bytes, int repeats, double *gbps, double *ms_median, char *err, size_t errlen);
#endif

#ifdef __cplusplus
}
#endif

#endif
