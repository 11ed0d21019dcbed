/* attn.cu: the CUDA attention path. A device mirror of a KVCache's lanes (vectors in their storage types, the f32
 * residual region, live lists), kernels that store tokens into the slots kv.c names (rotating as kv.c does, encoding
 * with kv_encode's own codec, kv_codec.h), decode attention over each lane's live slots (GQA: a kv head's query
 * heads share one pass; split over the sequence and merged with an online softmax, as flash-decoding does), and the
 * per-slot probabilities the policies read. Every kernel has a CPU twin built from the same __host__ __device__
 * pieces (the "host mirror", which tests/test_attn.cu checks against kv_attend_cpu on machines without a GPU); without
 * nvcc this file is compiled as plain C++ for that twin alone. It deliberately keeps policy decisions and positions
 * on the host: the device needs only each lane's live list, whose order is the rank order pos=cache rotates by.
 *
 * Dimensions: n_lanes (= n_layers * n_kv_heads), n_heads, n_kv_heads, group (= n_heads / n_kv_heads), head_dim,
 * budget (slots per lane), Q (typed slots per lane), R (f32 residual slots per lane), chunk (ranks per split).
 * Indices: j lane within a launch, hh query head within a group, i rank in a live list, s slot, e element.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "kv.h"
#include "kv_codec.h"
}
#include "attn.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define HD __host__ __device__
#else
#define HD
#endif

#define ATTN_THREADS 128           /* threads per attention block */
#define ATTN_CHUNK_MIN 64          /* ranks per split, at least */
#define ATTN_SMEM_FLOATS 12288     /* 48 KiB of shared memory per block: no opt-in needed on any GPU */
#define ATTN_EPT_MAX 16            /* elements of a vector one thread holds */
#define ATTN_SENTINEL 64           /* bytes of 0xA5 after every output buffer, checked by the tests */

/* ---------------------------------------------------------------------------------------------------------------
 * Storage encoding: kv_codec.h, the codec kv.c's kv_encode and kv_decode loop over, compiled here for the device and
 * the twin. A vector's units (groups of G = gcd(head_dim, 32) elements for q8 and q4; single elements otherwise) are
 * encoded by different threads; tests/test_attn.cu checks the twin's bytes against kv_encode.
 * ------------------------------------------------------------------------------------------------------------- */

/* The codec by head_dim (hd): encode unit u of x (hd) into the vector at dst (kv_vector_bytes(ty, hd) bytes), the
 * number of units of a vector, and element e of a stored vector. */
static HD void enc_unit(uint8_t *dst, int ty, const float *x, int hd, int u) {
    kv_encode_unit(dst, ty, x, kv_group(hd), u);
}
static HD int enc_units(int ty, int hd) { return kv_codec_units(ty, hd, kv_group(hd)); }
static HD float load_elem(int ty, const uint8_t *vec, int e, int hd) {
    return kv_decode_elem(ty, vec, e, kv_group(hd));
}

/* ---------------------------------------------------------------------------------------------------------------
 * The mirror: geometry, buffers, and the queue of slot events waiting to be applied.
 * ------------------------------------------------------------------------------------------------------------- */

/* One slot event (kv.h, KVSlotFn), as staged for the device. */
typedef struct { int kind, lane, slot, from, rank, data; } Op;   /* data: float offset of k, v, cs in the pool */
#define OP_INTS 6

typedef struct {
    int n_lanes, n_kv, n_heads, group, hd, budget, Q, R, ktype, vtype, pos_cache, pairing;
    int k_bytes, v_bytes;
    int tps, ept;                  /* threads per slot (a power of two dividing 32) and elements each holds */
    float scale;                   /* 1/sqrt(head_dim) */
} Geo;

/* Buffers in device memory (or host memory for the twin), carved from allocations as noted. */
typedef struct {
    uint8_t *k, *v;        /* (n_lanes, Q, k_bytes) typed keys, then (n_lanes, R, head_dim) f32 keys; same for v */
    int *live;             /* (n_lanes, budget) live lists */
    float *rope_rank;      /* (budget, head_dim/2, 2) cos, sin by rank (pos=cache) or NULL */
    float *scores;         /* (launch_lanes * group, budget) scores, then probabilities; + sentinel */
    float *part;           /* (launch_lanes, max_splits, group, head_dim + 2) split results: acc, max, sum; + sentinel */
    float *out;            /* (launch_lanes * group, head_dim) attention output; + sentinel */
    float *ml;             /* (launch_lanes * group, 2) final max and sum of exp; + sentinel */
    uint8_t *stage;        /* (stage_cap) bytes: the upload of one attend (see mirror_stage) */
} Bufs;

struct AttnDevice {
    int on_host;           /* 1: the CPU twin: Bufs in host memory, kernels run as host loops */
    Geo g;
    Bufs b;
    int launch_lanes;      /* lanes one launch covers: n_kv_heads (one layer), or all lanes for the benchmark */
    int max_splits;
    size_t cache_bytes, work_bytes, stage_cap;
    uint8_t *stage_h;      /* (stage_cap) host side of the upload (pinned on the device path) */
    /* host queue of slot events since the last attend */
    Op *ops; int n_ops, cap_ops;
    float *pool; size_t n_pool, cap_pool;
    int *dirty;            /* (n_lanes) smallest live rank changed since the last upload; budget = clean */
    int n_sm;
    KVShape shape;         /* for the cos, sin of stored positions */
    char name[256];        /* the device's name */
    float cs_last[1024];   /* (head_dim/2, 2) cos, sin of position cs_pos */
    int cs_pos;
#ifdef __CUDACC__
    cudaStream_t stream;
#endif
};

/* Threads per slot: the largest power of two p <= 32 dividing head_dim/2 with head_dim/p >= 8 (16 bytes of f16 per
 * thread), so each thread holds whole adjacent RoPE pairs; 1 for head_dim < 16. Returns 0 when head_dim/p would pass
 * ATTN_EPT_MAX (the kernels then do not take the model). */
static HD int plan_tps(int hd) {
    int p = 1;
    while (p < 32 && (hd / 2) % (2 * p) == 0 && hd / (2 * p) >= 8) p *= 2;
    return hd / p <= ATTN_EPT_MAX ? p : 0;
}

/* Shared floats a block needs besides the scores, and the chunk (ranks per split) for lanes of up to n_max live
 * slots: enough splits to give every SM two blocks, at least ATTN_CHUNK_MIN ranks each, within shared memory. */
static HD int smem_fixed(int group, int hd, int ept) {
    int hb = ept <= 8 ? 4 : 2;
    return group * hd + ATTN_THREADS * ept * hb + 2 * group + 64;
}
static HD int chunk_max(int group, int hd, int ept) { return (ATTN_SMEM_FLOATS - smem_fixed(group, hd, ept)) / group / 32 * 32; }
static HD int plan_chunk(int n_max, int launch_lanes, int group, int hd, int ept, int n_sm) {
    int want_splits = (2 * n_sm + launch_lanes - 1) / launch_lanes;
    int chunk = (n_max + want_splits - 1) / want_splits;
    chunk = (chunk + 31) / 32 * 32;
    if (chunk < ATTN_CHUNK_MIN) chunk = ATTN_CHUNK_MIN;
    int cm = chunk_max(group, hd, ept);
    return chunk < cm ? chunk : cm;
}

static HD const uint8_t *slot_vec(const uint8_t *base, const Geo *g, int lane, int slot, int bytes, int *ty, int t) {
    if (slot < g->Q) { *ty = t; return base + ((size_t)lane * g->Q + slot) * bytes; }
    *ty = KV_F32;
    return base + (size_t)g->n_lanes * g->Q * bytes + ((size_t)lane * g->R + (slot - g->Q)) * g->hd * 4;
}

/* RoPE on one pair, with kv.c's rope_apply arithmetic, each product and sum rounded on its own (kv_codec.h's kv_mul_rn
 * and friends: nvcc would otherwise fuse them into multiply-adds, and the host side is built with -ffp-contract=off). */
static HD void rope_pair(float *x0, float *x1, float c, float s) {
    float a = *x0, b = *x1;
    *x0 = kv_sub_rn(kv_mul_rn(a, c), kv_mul_rn(b, s));
    *x1 = kv_add_rn(kv_mul_rn(a, s), kv_mul_rn(b, c));
}
/* The element indices of pair p (0 .. head_dim/2 - 1) under the model's pairing. */
static HD void pair_index(int pairing, int hd, int p, int *i0, int *i1) {
    *i0 = pairing ? p : 2 * p;
    *i1 = pairing ? p + hd / 2 : 2 * p + 1;
}

/* Apply one slot event to lane op->lane. One caller per lane, events in order; `worker`/`n_workers` split a vector's
 * units (the device runs a block per lane; the twin one worker). x is head_dim floats of scratch. */
static HD void hd_sync(void) {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
}

static HD void apply_op(const Bufs *b, const Geo *g, const Op *op, const float *pool, float *x, int worker,
                        int n_workers) {
    int hd = g->hd, ty;
    if (op->kind == KV_SLOT_STORE) {
        const float *k = pool + op->data, *v = k + hd, *cs = v + hd;
        for (int e = worker; e < hd; e += n_workers) x[e] = k[e];
        hd_sync();
        if (!g->pos_cache)
            for (int p = worker; p < hd / 2; p += n_workers) {
                int i0, i1;
                pair_index(g->pairing, hd, p, &i0, &i1);
                rope_pair(&x[i0], &x[i1], cs[2 * p], cs[2 * p + 1]);
            }
        hd_sync();
        uint8_t *kd = (uint8_t *)slot_vec(b->k, g, op->lane, op->slot, g->k_bytes, &ty, g->ktype);
        for (int u = worker; u < enc_units(ty, hd); u += n_workers) enc_unit(kd, ty, x, hd, u);
        uint8_t *vd = (uint8_t *)slot_vec(b->v, g, op->lane, op->slot, g->v_bytes, &ty, g->vtype);
        for (int u = worker; u < enc_units(ty, hd); u += n_workers) enc_unit(vd, ty, v, hd, u);
    } else if (op->kind == KV_SLOT_MOVE) {   /* f32 residual slot `from` -> typed slot `slot`, keys and values */
        for (int kv = 0; kv < 2; kv++) {
            int fty, tty;
            const uint8_t *base = kv ? b->v : b->k;
            int bytes = kv ? g->v_bytes : g->k_bytes, t = kv ? g->vtype : g->ktype;
            const float *src = (const float *)(const void *)slot_vec(base, g, op->lane, op->from, bytes, &fty, t);
            uint8_t *dst = (uint8_t *)slot_vec(base, g, op->lane, op->slot, bytes, &tty, t);
            for (int u = worker; u < enc_units(tty, hd); u += n_workers) enc_unit(dst, tty, src, hd, u);
        }
    }
    hd_sync();
}

/* ---------------------------------------------------------------------------------------------------------------
 * The upload of one attend (one host-to-device copy), laid out in `stage`:
 *   header (16 ints): n_ops, n_segs, pool floats, offsets of each part in bytes
 *   q (launch_lanes * group, head_dim) before RoPE; cs_q (head_dim/2, 2) the query's cos, sin (pos=orig);
 *   n_live (launch_lanes); ops (n_ops, OP_INTS); segs (n_segs, 3: lane, first rank, count) and their live entries;
 *   pool (k, v, cs of each STORE).
 * ------------------------------------------------------------------------------------------------------------- */
enum { H_NOPS, H_NSEGS, H_Q, H_CSQ, H_NLIVE, H_OPS, H_SEGS, H_SEGDATA, H_POOL, H_END, H_INTS = 16 };

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Parameters of one attention launch over `n_lanes` consecutive lanes from lane0. */
typedef struct {
    Geo g;
    const uint8_t *k, *v;
    const int *live;
    const int *n_live;     /* (n_lanes) */
    const float *q;        /* (n_lanes * group, head_dim) */
    const float *cs_q;     /* (head_dim/2, 2) */
    const float *rope_rank;
    float *scores, *part, *out, *ml;
    int lane0, n_lanes, chunk, max_splits, pitch;
    int grid_splits;       /* splits of the longest lane: ceil(n_max / chunk) <= max_splits */
} Launch;

/* ---------------------------------------------------------------------------------------------------------------
 * The CPU twin of the attention kernels: the same splits, the same per-split max/sum/accumulator and the same merge,
 * as plain loops over the same buffers.
 * ------------------------------------------------------------------------------------------------------------- */

static void twin_rotated_query(const Launch *L, int j, int hh, int n, float *qr) {
    const Geo *g = &L->g;
    int hd = g->hd;
    memcpy(qr, L->q + ((size_t)j * g->group + hh) * hd, (size_t)hd * sizeof(float));
    const float *cs = g->pos_cache ? L->rope_rank + (size_t)(n - 1) * hd : L->cs_q;
    for (int p = 0; p < hd / 2; p++) {
        int i0, i1;
        pair_index(g->pairing, hd, p, &i0, &i1);
        rope_pair(&qr[i0], &qr[i1], cs[2 * p], cs[2 * p + 1]);
    }
}

static void twin_attention(const Launch *L) {
    const Geo *g = &L->g;
    int hd = g->hd, G = g->group;
    float *qr = (float *)malloc((size_t)G * hd * sizeof(float)), *x = (float *)malloc((size_t)hd * sizeof(float));
    float *acc = (float *)malloc((size_t)G * hd * sizeof(float));
    for (int j = 0; j < L->n_lanes; j++) {
        int lane = L->lane0 + j, n = L->n_live[j];
        for (int hh = 0; hh < G; hh++) twin_rotated_query(L, j, hh, n, qr + (size_t)hh * hd);
        for (int split = 0; split * L->chunk < n; split++) {
            int i0 = split * L->chunk, i1 = i0 + L->chunk < n ? i0 + L->chunk : n;
            /* phase 1: scores */
            for (int i = i0; i < i1; i++) {
                int slot = L->live[(size_t)lane * g->budget + i], ty;
                const uint8_t *kv = slot_vec(L->k, g, lane, slot, g->k_bytes, &ty, g->ktype);
                for (int e = 0; e < hd; e++) x[e] = load_elem(ty, kv, e, hd);
                if (g->pos_cache)
                    for (int p = 0; p < hd / 2; p++) {
                        int a, b;
                        pair_index(g->pairing, hd, p, &a, &b);
                        rope_pair(&x[a], &x[b], L->rope_rank[(size_t)i * hd + 2 * p], L->rope_rank[(size_t)i * hd + 2 * p + 1]);
                    }
                for (int hh = 0; hh < G; hh++) {
                    float dot = 0;
                    for (int e = 0; e < hd; e++) dot += qr[(size_t)hh * hd + e] * x[e];
                    L->scores[((size_t)j * G + hh) * L->pitch + i] = dot * g->scale;
                }
            }
            /* split max and sum, then values */
            for (int hh = 0; hh < G; hh++) {
                float *s = L->scores + ((size_t)j * G + hh) * L->pitch, m = -INFINITY, l = 0;
                for (int i = i0; i < i1; i++) m = fmaxf(m, s[i]);
                for (int i = i0; i < i1; i++) l += expf(s[i] - m);
                float *pp = L->part + (((size_t)j * L->max_splits + split) * G + hh) * (hd + 2);
                for (int e = 0; e < hd; e++) acc[e] = 0;
                for (int i = i0; i < i1; i++) {
                    int slot = L->live[(size_t)lane * g->budget + i], ty;
                    const uint8_t *vv = slot_vec(L->v, g, lane, slot, g->v_bytes, &ty, g->vtype);
                    float w = expf(s[i] - m);
                    for (int e = 0; e < hd; e++) acc[e] += w * load_elem(ty, vv, e, hd);
                }
                memcpy(pp, acc, (size_t)hd * sizeof(float));
                pp[hd] = m;
                pp[hd + 1] = l;
            }
        }
        /* merge the splits; probabilities from the final max and sum */
        for (int hh = 0; hh < G; hh++) {
            int n_splits = (n + L->chunk - 1) / L->chunk;
            float M = -INFINITY, Lsum = 0;
            for (int sp = 0; sp < n_splits; sp++)
                M = fmaxf(M, L->part[(((size_t)j * L->max_splits + sp) * G + hh) * (hd + 2) + hd]);
            for (int sp = 0; sp < n_splits; sp++) {
                const float *pp = L->part + (((size_t)j * L->max_splits + sp) * G + hh) * (hd + 2);
                Lsum += pp[hd + 1] * expf(pp[hd] - M);
            }
            float *o = L->out + ((size_t)j * G + hh) * hd;
            for (int e = 0; e < hd; e++) {
                float sum = 0;
                for (int sp = 0; sp < n_splits; sp++) {
                    const float *pp = L->part + (((size_t)j * L->max_splits + sp) * G + hh) * (hd + 2);
                    sum += pp[e] * expf(pp[hd] - M);
                }
                o[e] = sum / Lsum;
            }
            L->ml[((size_t)j * G + hh) * 2] = M;
            L->ml[((size_t)j * G + hh) * 2 + 1] = Lsum;
            float *s = L->scores + ((size_t)j * G + hh) * L->pitch, inv = 1.0f / Lsum;
            for (int i = 0; i < n; i++) s[i] = expf(s[i] - M) * inv;
        }
    }
    free(qr); free(x); free(acc);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The kernels (nvcc only).
 * ------------------------------------------------------------------------------------------------------------- */
#ifdef __CUDACC__

/* One block per lane: apply that lane's events in order. */
__global__ void ops_kernel(Bufs b, Geo g, const Op *ops, int n_ops, const float *pool) {
    __shared__ float x[1024];   /* head_dim <= 512 (plan_tps) */
    int lane = blockIdx.x;
    for (int o = 0; o < n_ops; o++) {
        Op op = ops[o];
        if (op.lane != lane) continue;
        apply_op(&b, &g, &op, pool, x, threadIdx.x, blockDim.x);
    }
}

/* One block per segment: copy live entries into the lane's live list. */
__global__ void live_kernel(int *live, int budget, const int *segs, const int *segdata) {
    int lane = segs[3 * blockIdx.x], first = segs[3 * blockIdx.x + 1], count = segs[3 * blockIdx.x + 2];
    int off = 0;
    for (int s = 0; s < (int)blockIdx.x; s++) off += segs[3 * s + 2];
    for (int i = threadIdx.x; i < count; i += blockDim.x) live[(size_t)lane * budget + first + i] = segdata[off + i];
}

/* ept elements from e0 of a stored vector into x: 16-byte loads when they are aligned, else element by element. */
template <int EPTMAX>
static __device__ __forceinline__ void load_slice(float *x, int ty, const uint8_t *vec, int e0, int ept, int hd) {
    if ((ty == KV_F16 || ty == KV_BF16) && ept == 8 && (((uintptr_t)(vec + 2 * e0)) & 15) == 0) {
        uint4 w = *(const uint4 *)(const void *)(vec + 2 * e0);
        uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 8 && e < EPTMAX; e++) {
            uint16_t h = (uint16_t)(ws[e / 2] >> (16 * (e & 1)));
            x[e] = ty == KV_F16 ? __half2float(__ushort_as_half(h)) : __uint_as_float((uint32_t)h << 16);
        }
        return;
    }
    if (ty == KV_F32 && (ept & 3) == 0 && (((uintptr_t)(vec + 4 * e0)) & 15) == 0) {
#pragma unroll
        for (int e = 0; e < EPTMAX; e += 4)
            if (e < ept) {
                float4 f = *(const float4 *)(const void *)(vec + 4 * (e0 + e));
                x[e] = f.x; x[e + 1] = f.y; x[e + 2] = f.z; x[e + 3] = f.w;
            }
        return;
    }
#pragma unroll
    for (int e = 0; e < EPTMAX; e++)
        if (e < ept) x[e] = load_elem(ty, vec, e0 + e, hd);
}

/* RoPE on a slice held by a team of tps threads (thread `sub` holds elements e0 .. e0+ept-1), with table row cs.
 * Adjacent pairs lie inside a thread; halves pairs (e, e + head_dim/2) lie in thread sub ^ tps/2 at the same index. */
template <int EPTMAX>
static __device__ __forceinline__ void rope_slice(float *x, const Geo &g, const float *cs, int sub, int e0,
                                                  unsigned mask) {
    int hd = g.hd, ept = g.ept;
    if (!g.pairing) {
#pragma unroll
        for (int e = 0; e < EPTMAX; e += 2)
            if (e < ept) { int p = (e0 + e) / 2; rope_pair(&x[e], &x[e + 1], cs[2 * p], cs[2 * p + 1]); }
    } else if (g.tps == 1) {
#pragma unroll
        for (int e = 0; e < EPTMAX / 2; e++)
            if (e < ept / 2) rope_pair(&x[e], &x[e + ept / 2], cs[2 * e], cs[2 * e + 1]);
    } else {
        int lower = sub < g.tps / 2;
#pragma unroll
        for (int e = 0; e < EPTMAX; e++)
            if (e < ept) {
                float other = __shfl_xor_sync(mask, x[e], g.tps / 2);
                int p = (e0 + e) % (hd / 2);
                float c = cs[2 * p], s = cs[2 * p + 1];
                float a = lower ? x[e] : other, b = lower ? other : x[e];
                x[e] = lower ? kv_sub_rn(kv_mul_rn(a, c), kv_mul_rn(b, s)) : kv_add_rn(kv_mul_rn(a, s), kv_mul_rn(b, c));
            }
    }
}

static __device__ float block_reduce(float v, int is_max, float *scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    int warp = threadIdx.x / 32, nw = blockDim.x / 32;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < nw; w++) v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
    return v;
}

/* One block per (split, lane): scores of the split's ranks for every query head of the group (one pass over K), the
 * split's max and sum of exp, and its value accumulator (one pass over V per HB heads). */
template <int EPTMAX, int HB>
__global__ void __launch_bounds__(ATTN_THREADS) attn_split_kernel(Launch L) {
    const Geo &g = L.g;
    int j = blockIdx.y, split = blockIdx.x, n = L.n_live[j];
    int i0 = split * L.chunk;
    if (i0 >= n) return;
    int i1 = min(n, i0 + L.chunk), len = i1 - i0, lane = L.lane0 + j;
    int hd = g.hd, G = g.group, tid = threadIdx.x;
    extern __shared__ float sh[];
    float *q_sh = sh;                             /* (group, head_dim) rotated queries */
    float *s_sh = q_sh + G * hd;                  /* (group, chunk) scores, then exp(s - m) */
    float *red = s_sh + G * L.chunk;              /* (teams, HB, head_dim) accumulators across teams */
    float *stat = red + ATTN_THREADS * g.ept * HB;   /* (group, 2) split max and sum */
    float *scratch = stat + 2 * G;                /* (32) block reductions */
    /* rotated queries */
    const float *cs_q = g.pos_cache ? L.rope_rank + (size_t)(n - 1) * hd : L.cs_q;
    for (int idx = tid; idx < G * hd / 2; idx += blockDim.x) {
        int hh = idx / (hd / 2), p = idx % (hd / 2), a, b;
        pair_index(g.pairing, hd, p, &a, &b);
        const float *qh = L.q + ((size_t)j * G + hh) * hd;
        float x0 = qh[a], x1 = qh[b];
        rope_pair(&x0, &x1, cs_q[2 * p], cs_q[2 * p + 1]);
        q_sh[hh * hd + a] = x0;
        q_sh[hh * hd + b] = x1;
    }
    __syncthreads();
    int tps = g.tps, ept = g.ept, team = tid / tps, sub = tid % tps, n_teams = ATTN_THREADS / tps, e0 = sub * ept;
    unsigned mask = tps == 32 ? 0xffffffffu : ((1u << tps) - 1) << ((tid & 31) / tps * tps);
    const int *live = L.live + (size_t)lane * g.budget;
    /* phase 1: scores, one pass over the split's keys */
    for (int i = i0 + team; i < i1; i += n_teams) {
        int ty, slot = live[i];
        const uint8_t *kv = slot_vec(L.k, &g, lane, slot, g.k_bytes, &ty, g.ktype);
        float x[EPTMAX] = {0};
        load_slice<EPTMAX>(x, ty, kv, e0, ept, hd);
        if (g.pos_cache) rope_slice<EPTMAX>(x, g, L.rope_rank + (size_t)i * hd, sub, e0, mask);
        for (int hh = 0; hh < G; hh++) {
            float dot = 0;
#pragma unroll
            for (int e = 0; e < EPTMAX; e++)
                if (e < ept) dot += q_sh[hh * hd + e0 + e] * x[e];
            for (int o = tps / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(mask, dot, o);
            if (sub == 0) {
                float s = dot * g.scale;
                s_sh[hh * L.chunk + (i - i0)] = s;
                L.scores[((size_t)j * G + hh) * L.pitch + i] = s;
            }
        }
    }
    __syncthreads();
    /* the split's max and sum of exp per head; s_sh becomes exp(s - m) */
    for (int hh = 0; hh < G; hh++) {
        float m = -INFINITY;
        for (int i = tid; i < len; i += blockDim.x) m = fmaxf(m, s_sh[hh * L.chunk + i]);
        m = block_reduce(m, 1, scratch);
        float l = 0;
        for (int i = tid; i < len; i += blockDim.x) {
            float w = expf(s_sh[hh * L.chunk + i] - m);
            s_sh[hh * L.chunk + i] = w;
            l += w;
        }
        l = block_reduce(l, 0, scratch);
        if (tid == 0) { stat[2 * hh] = m; stat[2 * hh + 1] = l; }
    }
    __syncthreads();
    /* phase 2: values, HB heads per pass */
    float *part = L.part + ((size_t)j * L.max_splits + split) * G * (hd + 2);
    for (int hb0 = 0; hb0 < G; hb0 += HB) {
        float acc[HB][EPTMAX];
#pragma unroll
        for (int b = 0; b < HB; b++)
#pragma unroll
            for (int e = 0; e < EPTMAX; e++) acc[b][e] = 0;
        for (int i = i0 + team; i < i1; i += n_teams) {
            int ty, slot = live[i];
            const uint8_t *vv = slot_vec(L.v, &g, lane, slot, g.v_bytes, &ty, g.vtype);
            float x[EPTMAX] = {0};
            load_slice<EPTMAX>(x, ty, vv, e0, ept, hd);
#pragma unroll
            for (int b = 0; b < HB; b++)
                if (hb0 + b < G) {
                    float w = s_sh[(hb0 + b) * L.chunk + (i - i0)];
#pragma unroll
                    for (int e = 0; e < EPTMAX; e++) acc[b][e] += w * x[e];
                }
        }
#pragma unroll
        for (int b = 0; b < HB; b++)
#pragma unroll
            for (int e = 0; e < EPTMAX; e++)
                if (e < ept) red[(team * HB + b) * hd + e0 + e] = acc[b][e];
        __syncthreads();
        for (int idx = tid; idx < HB * hd; idx += blockDim.x) {
            int b = idx / hd, d = idx % hd;
            if (hb0 + b >= G) continue;
            float sum = 0;
            for (int t = 0; t < n_teams; t++) sum += red[(t * HB + b) * hd + d];
            part[(size_t)(hb0 + b) * (hd + 2) + d] = sum;
        }
        __syncthreads();
    }
    for (int hh = tid; hh < G; hh += blockDim.x) {
        part[(size_t)hh * (hd + 2) + hd] = stat[2 * hh];
        part[(size_t)hh * (hd + 2) + hd + 1] = stat[2 * hh + 1];
    }
}

/* One block per (lane, query head): merge the splits (online softmax), write the output, the final max and sum. */
__global__ void attn_merge_kernel(Launch L) {
    int G = L.g.group, hd = L.g.hd, j = blockIdx.x / G, hh = blockIdx.x % G, n = L.n_live[j];
    int n_splits = (n + L.chunk - 1) / L.chunk;
    const float *part = L.part + (size_t)j * L.max_splits * G * (hd + 2) + (size_t)hh * (hd + 2);
    size_t stride = (size_t)G * (hd + 2);
    float M = -INFINITY, S = 0;
    for (int sp = 0; sp < n_splits; sp++) M = fmaxf(M, part[sp * stride + hd]);
    for (int sp = 0; sp < n_splits; sp++) S += part[sp * stride + hd + 1] * expf(part[sp * stride + hd] - M);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float sum = 0;
        for (int sp = 0; sp < n_splits; sp++) sum += part[sp * stride + d] * expf(part[sp * stride + hd] - M);
        L.out[((size_t)j * G + hh) * hd + d] = sum / S;
    }
    if (threadIdx.x == 0) { L.ml[((size_t)j * G + hh) * 2] = M; L.ml[((size_t)j * G + hh) * 2 + 1] = S; }
}

/* Scores to probabilities in place, from the final max and sum: the score buffer only, not K again. */
__global__ void attn_probs_kernel(Launch L) {
    int row = blockIdx.y, j = row / L.g.group, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= L.n_live[j]) return;
    float M = L.ml[2 * row], inv = 1.0f / L.ml[2 * row + 1];
    float *s = L.scores + (size_t)row * L.pitch + i;
    *s = expf(*s - M) * inv;
}

static void cuda_fail(cudaError_t e, const char *what, const char *file, int line) {
    fprintf(stderr, "run: CUDA error in %s (%s:%d): %s\n", what, file, line, cudaGetErrorString(e));
    exit(EXIT_FAILURE);
}
#define CK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) cuda_fail(e_, #call, __FILE__, __LINE__); } while (0)

static void launch_attention(const Launch *L, int want_probs, cudaStream_t st) {
    dim3 grid(L->grid_splits, L->n_lanes);
    size_t smem = (size_t)(smem_fixed(L->g.group, L->g.hd, L->g.ept) + L->g.group * L->chunk) * sizeof(float);
    if (L->g.ept <= 8) attn_split_kernel<8, 4><<<grid, ATTN_THREADS, smem, st>>>(*L);
    else attn_split_kernel<16, 2><<<grid, ATTN_THREADS, smem, st>>>(*L);
    CK(cudaGetLastError());
    attn_merge_kernel<<<L->n_lanes * L->g.group, 128, 0, st>>>(*L);
    CK(cudaGetLastError());
    if (want_probs) {
        dim3 pg((L->pitch + 255) / 256, L->n_lanes * L->g.group);
        attn_probs_kernel<<<pg, 256, 0, st>>>(*L);
        CK(cudaGetLastError());
    }
}
#endif /* __CUDACC__ */

/* ---------------------------------------------------------------------------------------------------------------
 * The mirror on the host side: slot events, the upload, attend (device or twin).
 * ------------------------------------------------------------------------------------------------------------- */

static void *xmalloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) { fprintf(stderr, "run: out of memory (%zu bytes)\n", n); exit(EXIT_FAILURE); }
    return p;
}

static void mirror_on_slot(void *ctx, KVSlotEvent ev, int lane, int slot, int from, int rank, int pos,
                           const float *k, const float *v) {
    AttnDevice *d = (AttnDevice *)ctx;
    const Geo *g = &d->g;
    if (ev == KV_SLOT_RESET) {   /* pending events are moot: every slot is free */
        d->n_ops = 0; d->n_pool = 0;
        for (int i = 0; i < g->n_lanes; i++) d->dirty[i] = 0;
        return;
    }
    if (rank < d->dirty[lane]) d->dirty[lane] = rank;
    if (ev == KV_SLOT_FREE) return;
    if (d->n_ops == d->cap_ops) {
        d->cap_ops = d->cap_ops ? 2 * d->cap_ops : 64;
        d->ops = (Op *)realloc(d->ops, (size_t)d->cap_ops * sizeof(Op));
        if (!d->ops) { fprintf(stderr, "run: out of memory\n"); exit(EXIT_FAILURE); }
    }
    Op *op = &d->ops[d->n_ops++];
    op->kind = ev; op->lane = lane; op->slot = slot; op->from = from; op->rank = rank; op->data = -1;
    if (ev == KV_SLOT_STORE) {
        size_t need = d->n_pool + 3 * (size_t)g->hd;
        if (need > d->cap_pool) {
            d->cap_pool = need * 2;
            d->pool = (float *)realloc(d->pool, d->cap_pool * sizeof(float));
            if (!d->pool) { fprintf(stderr, "run: out of memory\n"); exit(EXIT_FAILURE); }
        }
        float *p = d->pool + d->n_pool;
        memcpy(p, k, (size_t)g->hd * sizeof(float));
        memcpy(p + g->hd, v, (size_t)g->hd * sizeof(float));
        if (!g->pos_cache) {   /* pos=orig: the store rotates by pos; the lanes of a step share one table */
            if (d->cs_pos != pos) { kv_rope_cs(d->cs_last, &d->shape, pos); d->cs_pos = pos; }
            memcpy(p + 2 * g->hd, d->cs_last, (size_t)g->hd * sizeof(float));
        }
        op->data = (int)d->n_pool;
        d->n_pool = need;
    }
}

/* Geometry of a cache; 0, or -1 + message when the kernels cannot take it. */
static int geo_of(Geo *g, const KVCache *c, char *err, size_t errlen) {
    const KVShape *s = &c->shape;
    memset(g, 0, sizeof *g);
    g->n_lanes = s->n_layers * s->n_kv_heads;
    g->n_kv = s->n_kv_heads;
    g->n_heads = s->n_heads;
    g->group = s->n_heads / s->n_kv_heads;
    g->hd = s->head_dim;
    g->budget = c->budget;
    g->R = c->residual;
    g->Q = c->budget - c->residual;
    g->ktype = c->spec.ktype;
    g->vtype = c->spec.vtype;
    g->pos_cache = c->spec.pos == POS_CACHE;
    g->pairing = s->rope_pairing;
    g->k_bytes = (int)c->k_bytes;
    g->v_bytes = (int)c->v_bytes;
    g->tps = plan_tps(g->hd);
    g->ept = g->tps ? g->hd / g->tps : 0;
    g->scale = 1.0f / sqrtf((float)g->hd);
    const KVPolicyOps *ops = c->policy.ops;
    int ragged = 0;
    for (int i = 0; i < g->n_lanes; i++) ragged |= c->lanes[i].cap != c->budget;
    if (c->merge_evict) {   /* a merged key is a weighted mean of rotated keys: no pre-RoPE k the STORE event has */
        snprintf(err, errlen, "'%s' is not on the CUDA path yet: merge=1 (merge-on-evict) rewrites kept slots with "
                 "merged keys and values, which the mirror is not told; run it with -d cpu", c->spec.text);
        return -1;
    }
    if (c->n_bands > 2 || (c->n_bands == 2 && !c->residual) || ops->merge || ops->select || ragged || c->tiers
        || c->krank || c->vrank) {
        snprintf(err, errlen, "'%s' is not on the CUDA path yet: the mirror takes one precision band or an f32 "
                 "residual over one type, eviction-family policies, equal lanes, one memory tier and full rank (no "
                 "prec= beyond that, no merging or selection policy, no ragged budgets, no fast=, no rank=); run it "
                 "with -d cpu",
                 c->spec.text);
        return -1;
    }
    if (c->pool) {   /* a paged lane moves slots down when it gives a page back (kv.c, lane_shed_pages), untold */
        snprintf(err, errlen, "'%s' is not on the CUDA path yet: its lanes are paged (%s) and move slots when they give "
                 "pages back, which the mirror is not told; run it with -d cpu", c->spec.text,
                 c->ada ? "alloc=ada" : "a serving pool");
        return -1;
    }
    if (c->kgroup) {
        snprintf(err, errlen, "'%s' is not on the CUDA path yet: the mirror stores keys per token, not per channel "
                 "(kgroup=channel); run it with -d cpu", c->spec.text);
        return -1;
    }
    if (!g->tps || g->hd > 512) {
        snprintf(err, errlen, "head_dim %d is not one the CUDA kernels take (even, at most 16 elements per thread "
                 "with up to 32 threads per vector)", g->hd);
        return -1;
    }
    if (chunk_max(g->group, g->hd, g->ept) < ATTN_CHUNK_MIN) {
        snprintf(err, errlen, "a GQA group of %d heads of head_dim %d does not fit the attention kernel's shared "
                 "memory", g->group, g->hd);
        return -1;
    }
    return 0;
}

/* Build the upload for an attend of layer l at position t (launch lanes l*n_kv ..), into d->stage_h; returns its
 * size. n_live_out gets the lanes' live counts; grows the staging buffers when needed. */
static size_t mirror_stage(AttnDevice *d, const KVCache *c, int l, int t, const float *q, int *n_max_out);

static void stage_grow(AttnDevice *d, size_t need);

static size_t mirror_stage(AttnDevice *d, const KVCache *c, int l, int t, const float *q, int *n_max_out) {
    const Geo *g = &d->g;
    int hd = g->hd, n_segs = 0;
    size_t seg_ints = 0;
    for (int i = 0; i < g->n_lanes; i++)
        if (d->dirty[i] < c->lanes[i].n_live) { n_segs++; seg_ints += (size_t)(c->lanes[i].n_live - d->dirty[i]); }
    size_t off[H_END + 1];
    off[H_NOPS] = 0;
    off[H_Q] = align256(H_INTS * sizeof(int));
    off[H_CSQ] = off[H_Q] + align256((size_t)g->n_heads * hd * sizeof(float));
    off[H_NLIVE] = off[H_CSQ] + align256((size_t)hd * sizeof(float));
    off[H_OPS] = off[H_NLIVE] + align256((size_t)d->launch_lanes * sizeof(int));
    off[H_SEGS] = off[H_OPS] + align256((size_t)d->n_ops * sizeof(Op));
    off[H_SEGDATA] = off[H_SEGS] + align256((size_t)n_segs * 3 * sizeof(int));
    off[H_POOL] = off[H_SEGDATA] + align256(seg_ints * sizeof(int));
    off[H_END] = off[H_POOL] + align256(d->n_pool * sizeof(float));
    stage_grow(d, off[H_END]);
    uint8_t *st = d->stage_h;
    int *hdr = (int *)(void *)st;
    hdr[H_NOPS] = d->n_ops;
    hdr[H_NSEGS] = n_segs;
    for (int i = H_Q; i <= H_END; i++) hdr[i] = (int)off[i];
    memcpy(st + off[H_Q], q, (size_t)g->n_heads * hd * sizeof(float));
    kv_rope_cs((float *)(void *)(st + off[H_CSQ]), &c->shape, t);
    int *nl = (int *)(void *)(st + off[H_NLIVE]), n_max = 0;
    for (int j = 0; j < g->n_kv; j++) {
        nl[j] = c->lanes[l * g->n_kv + j].n_live;
        if (nl[j] > n_max) n_max = nl[j];
    }
    if (d->n_ops) memcpy(st + off[H_OPS], d->ops, (size_t)d->n_ops * sizeof(Op));   /* ops may be NULL when none */
    int *segs = (int *)(void *)(st + off[H_SEGS]), *sd = (int *)(void *)(st + off[H_SEGDATA]), s = 0;
    for (int i = 0; i < g->n_lanes; i++) {
        const KVLane *ln = &c->lanes[i];
        if (d->dirty[i] < ln->n_live) {
            int cnt = ln->n_live - d->dirty[i];
            segs[3 * s] = i; segs[3 * s + 1] = d->dirty[i]; segs[3 * s + 2] = cnt;
            memcpy(sd, ln->live + d->dirty[i], (size_t)cnt * sizeof(int));
            sd += cnt;
            s++;
        }
        d->dirty[i] = g->budget;
    }
    if (d->n_pool) memcpy(st + off[H_POOL], d->pool, d->n_pool * sizeof(float));
    d->n_ops = 0;
    d->n_pool = 0;
    *n_max_out = n_max;
    return off[H_END];
}

static Launch launch_of(const AttnDevice *d, const uint8_t *stage_dev, int lane0, int n_lanes, int n_max) {
    Launch L;
    memset(&L, 0, sizeof L);
    const int *hdr = (const int *)(const void *)d->stage_h;   /* offsets are the same on both sides */
    L.g = d->g;
    L.k = d->b.k; L.v = d->b.v; L.live = d->b.live; L.rope_rank = d->b.rope_rank;
    L.q = (const float *)(const void *)(stage_dev + hdr[H_Q]);
    L.cs_q = (const float *)(const void *)(stage_dev + hdr[H_CSQ]);
    L.n_live = (const int *)(const void *)(stage_dev + hdr[H_NLIVE]);
    L.scores = d->b.scores; L.part = d->b.part; L.out = d->b.out; L.ml = d->b.ml;
    L.lane0 = lane0; L.n_lanes = n_lanes;
    L.chunk = plan_chunk(n_max, n_lanes, d->g.group, d->g.hd, d->g.ept, d->n_sm);
    L.max_splits = d->max_splits;
    L.grid_splits = (n_max + L.chunk - 1) / L.chunk;
    L.pitch = d->g.budget;
    return L;
}

/* Sizes of the workspace for launches over `lanes` lanes of up to budget slots. */
/* The most splits plan_chunk gives any lane of up to budget slots: the wanted count while the chunk is free, or
 * budget / chunk_max once shared memory caps the chunk. */
static int splits_for(const Geo *g, int lanes, int n_sm) {
    int want = (2 * n_sm + lanes - 1) / lanes, cm = chunk_max(g->group, g->hd, g->ept);
    int capped = (g->budget + cm - 1) / cm;
    return want > capped ? want : capped;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Creation (device or twin), attend, accounting.
 * ------------------------------------------------------------------------------------------------------------- */

static void fill_sentinel(AttnDevice *d, void *p, size_t bytes) {
#ifdef __CUDACC__
    if (!d->on_host) { cudaMemset((uint8_t *)p + bytes, 0xA5, ATTN_SENTINEL); return; }
#endif
    (void)d;
    memset((uint8_t *)p + bytes, 0xA5, ATTN_SENTINEL);
}

static int dev_alloc(AttnDevice *d, void **p, size_t bytes, int sentinel, size_t *acct) {
    size_t total = bytes + (sentinel ? ATTN_SENTINEL : 0);
    *acct += bytes;
#ifdef __CUDACC__
    if (!d->on_host) {
        if (cudaMalloc(p, total ? total : 16) != cudaSuccess) { *p = NULL; return -1; }
        cudaMemset(*p, 0, bytes);
        if (sentinel) fill_sentinel(d, *p, bytes);
        return 0;
    }
#endif
    *p = calloc(1, total ? total : 16);
    if (!*p) return -1;
    if (sentinel) fill_sentinel(d, *p, bytes);
    return 0;
}

static void dev_free(AttnDevice *d, void *p) {
    if (!p) return;
#ifdef __CUDACC__
    if (!d->on_host) { cudaFree(p); return; }
#endif
    (void)d;
    free(p);
}

static void stage_grow(AttnDevice *d, size_t need) {
    if (need <= d->stage_cap) return;
    size_t cap = need * 2;
#ifdef __CUDACC__
    if (!d->on_host) {
        if (d->b.stage) cudaFree(d->b.stage);
        if (d->stage_h) cudaFreeHost(d->stage_h);
        if (cudaMalloc((void **)&d->b.stage, cap) != cudaSuccess || cudaMallocHost((void **)&d->stage_h, cap) != cudaSuccess) {
            fprintf(stderr, "run: out of device memory for the attention upload (%zu bytes)\n", cap);
            exit(EXIT_FAILURE);
        }
        d->stage_cap = cap;
        return;
    }
#endif
    free(d->stage_h);
    d->stage_h = (uint8_t *)xmalloc(cap);
    d->b.stage = d->stage_h;
    d->stage_cap = cap;
}

static void mirror_free(AttnDevice *d) {
    if (!d) return;
    dev_free(d, d->b.k); dev_free(d, d->b.v); dev_free(d, d->b.live); dev_free(d, d->b.rope_rank);
    dev_free(d, d->b.scores); dev_free(d, d->b.part); dev_free(d, d->b.out); dev_free(d, d->b.ml);
#ifdef __CUDACC__
    if (!d->on_host) {
        if (d->b.stage) cudaFree(d->b.stage);
        if (d->stage_h) cudaFreeHost(d->stage_h);
        if (d->stream) cudaStreamDestroy(d->stream);
    } else
#endif
        free(d->stage_h);
    free(d->ops); free(d->pool); free(d->dirty);
    free(d);
}

/* Queue every live token of c as if it had just been stored (a mirror attached to a cache that already holds
 * tokens): typed slots are copied as stored bytes, which the twin and the device take the same way. */
static int mirror_upload_existing(AttnDevice *d, const KVCache *c);

static AttnDevice *mirror_new(KVCache *c, int on_host, int launch_lanes, char *err, size_t errlen) {
    AttnDevice *d = (AttnDevice *)xmalloc(sizeof *d);
    d->on_host = on_host;
    d->shape = c->shape;
    d->cs_pos = -1;
    if (geo_of(&d->g, c, err, errlen)) { free(d); return NULL; }
    Geo *g = &d->g;
    d->n_sm = 132;   /* the twin plans as for an H200, so its splits are the device's */
#ifdef __CUDACC__
    if (!on_host) {
        int dev = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&d->n_sm, cudaDevAttrMultiProcessorCount, dev);
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess) snprintf(d->name, sizeof d->name, "%s", prop.name);
        if (cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking) != cudaSuccess) {
            snprintf(err, errlen, "cannot create a CUDA stream");
            free(d);
            return NULL;
        }
    }
#endif
    d->launch_lanes = launch_lanes;
    d->max_splits = splits_for(g, launch_lanes, d->n_sm);
    size_t kb = (size_t)g->n_lanes * ((size_t)g->Q * g->k_bytes + (size_t)g->R * g->hd * 4);
    size_t vb = (size_t)g->n_lanes * ((size_t)g->Q * g->v_bytes + (size_t)g->R * g->hd * 4);
    size_t rows = (size_t)launch_lanes * g->group;
    int bad = dev_alloc(d, (void **)&d->b.k, kb, 0, &d->cache_bytes)
              | dev_alloc(d, (void **)&d->b.v, vb, 0, &d->cache_bytes)
              | dev_alloc(d, (void **)&d->b.live, (size_t)g->n_lanes * g->budget * sizeof(int), 0, &d->cache_bytes)
              | dev_alloc(d, (void **)&d->b.scores, rows * g->budget * sizeof(float), 1, &d->work_bytes)
              | dev_alloc(d, (void **)&d->b.part, (size_t)launch_lanes * d->max_splits * g->group * (g->hd + 2)
                          * sizeof(float), 1, &d->work_bytes)
              | dev_alloc(d, (void **)&d->b.out, rows * g->hd * sizeof(float), 1, &d->work_bytes)
              | dev_alloc(d, (void **)&d->b.ml, rows * 2 * sizeof(float), 1, &d->work_bytes);
    if (g->pos_cache) bad |= dev_alloc(d, (void **)&d->b.rope_rank, (size_t)g->budget * g->hd * sizeof(float), 0,
                                       &d->work_bytes);
    if (bad) {
        snprintf(err, errlen, "out of %s memory for the KV mirror (%zu bytes of cache, %zu of workspace)",
                 on_host ? "host" : "device", d->cache_bytes, d->work_bytes);
        mirror_free(d);
        return NULL;
    }
    if (g->pos_cache) {   /* the rank table, as kv.c builds it */
        float *tab = (float *)xmalloc((size_t)g->budget * g->hd * sizeof(float));
        for (int i = 0; i < g->budget; i++) kv_rope_cs(tab + (size_t)i * g->hd, &c->shape, i);
#ifdef __CUDACC__
        if (!on_host) cudaMemcpy(d->b.rope_rank, tab, (size_t)g->budget * g->hd * sizeof(float), cudaMemcpyHostToDevice);
        else
#endif
            memcpy(d->b.rope_rank, tab, (size_t)g->budget * g->hd * sizeof(float));
        free(tab);
    }
    d->dirty = (int *)xmalloc((size_t)g->n_lanes * sizeof(int));
    for (int i = 0; i < g->n_lanes; i++) d->dirty[i] = 0;
    stage_grow(d, 4096);
    if (mirror_upload_existing(d, c)) {
        snprintf(err, errlen, "cannot upload the cache's tokens to the mirror");
        mirror_free(d);
        return NULL;
    }
    c->on_slot = mirror_on_slot;
    c->slot_ctx = d;
    c->device = d;
    return d;
}

static int mirror_upload_existing(AttnDevice *d, const KVCache *c) {
    const Geo *g = &d->g;
    for (int lane = 0; lane < g->n_lanes; lane++) {
        const KVLane *ln = &c->lanes[lane];
        for (int i = 0; i < ln->n_live; i++) {
            int s = ln->live[i], ty;
            uint8_t *kd = (uint8_t *)slot_vec(d->b.k, g, lane, s, g->k_bytes, &ty, g->ktype);
            const uint8_t *ks = kv_slot_k(c, ln, s);
            size_t kn = s < g->Q ? (size_t)g->k_bytes : (size_t)g->hd * 4;
            uint8_t *vd = (uint8_t *)slot_vec(d->b.v, g, lane, s, g->v_bytes, &ty, g->vtype);
            const uint8_t *vs = kv_slot_v(c, ln, s);
            size_t vn = s < g->Q ? (size_t)g->v_bytes : (size_t)g->hd * 4;
#ifdef __CUDACC__
            if (!d->on_host) {
                if (cudaMemcpy(kd, ks, kn, cudaMemcpyHostToDevice) != cudaSuccess ||
                    cudaMemcpy(vd, vs, vn, cudaMemcpyHostToDevice) != cudaSuccess) return -1;
                continue;
            }
#endif
            memcpy(kd, ks, kn);
            memcpy(vd, vs, vn);
        }
        d->dirty[lane] = 0;
    }
    return 0;
}

/* Apply the staged events and live lists to the mirror, then run the attention of one layer. out (n_heads,
 * head_dim) and, when probs is not NULL, probs (n_heads, budget) rank order are written on the host. */
static void mirror_attend(AttnDevice *d, const KVCache *c, float *out, float *probs, int l, int t, const float *q) {
    const Geo *g = &d->g;
    int n_max = 0;
    size_t bytes = mirror_stage(d, c, l, t, q, &n_max);
    const int *hdr = (const int *)(const void *)d->stage_h;
    int n_ops = hdr[H_NOPS], n_segs = hdr[H_NSEGS];
    Launch L = launch_of(d, d->b.stage, l * g->n_kv, g->n_kv, n_max);
    if (d->on_host) {
        const Op *ops = (const Op *)(const void *)(d->b.stage + hdr[H_OPS]);
        const float *pool = (const float *)(const void *)(d->b.stage + hdr[H_POOL]);
        float *x = (float *)xmalloc((size_t)g->hd * sizeof(float));
        for (int o = 0; o < n_ops; o++) apply_op(&d->b, g, &ops[o], pool, x, 0, 1);
        free(x);
        const int *segs = (const int *)(const void *)(d->b.stage + hdr[H_SEGS]);
        const int *sd = (const int *)(const void *)(d->b.stage + hdr[H_SEGDATA]);
        for (int s = 0; s < n_segs; s++) {
            memcpy(d->b.live + (size_t)segs[3 * s] * g->budget + segs[3 * s + 1], sd, (size_t)segs[3 * s + 2] * sizeof(int));
            sd += segs[3 * s + 2];
        }
        twin_attention(&L);
        memcpy(out, d->b.out, (size_t)g->n_heads * g->hd * sizeof(float));
        if (probs)
            for (int h = 0; h < g->n_heads; h++)
                memcpy(probs + (size_t)h * g->budget, d->b.scores + (size_t)h * g->budget,
                       (size_t)L.n_live[h / g->group] * sizeof(float));
        return;
    }
#ifdef __CUDACC__
    cudaStream_t st = d->stream;
    CK(cudaMemcpyAsync(d->b.stage, d->stage_h, bytes, cudaMemcpyHostToDevice, st));
    if (n_ops) {
        ops_kernel<<<g->n_lanes, 128, 0, st>>>(d->b, *g, (const Op *)(const void *)(d->b.stage + hdr[H_OPS]), n_ops,
                                               (const float *)(const void *)(d->b.stage + hdr[H_POOL]));
        CK(cudaGetLastError());
    }
    if (n_segs) {
        live_kernel<<<n_segs, 256, 0, st>>>(d->b.live, g->budget, (const int *)(const void *)(d->b.stage + hdr[H_SEGS]),
                                            (const int *)(const void *)(d->b.stage + hdr[H_SEGDATA]));
        CK(cudaGetLastError());
    }
    launch_attention(&L, probs != NULL, st);
    CK(cudaMemcpyAsync(out, d->b.out, (size_t)g->n_heads * g->hd * sizeof(float), cudaMemcpyDeviceToHost, st));
    if (probs)
        CK(cudaMemcpy2DAsync(probs, (size_t)g->budget * sizeof(float), d->b.scores, (size_t)g->budget * sizeof(float),
                             (size_t)n_max * sizeof(float), (size_t)g->n_heads, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
#else
    (void)bytes;
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * The interface (attn.h).
 * ------------------------------------------------------------------------------------------------------------- */

int attn_twin_attach(KVCache *c, char *err, size_t errlen) {
    return mirror_new(c, 1, c->shape.n_kv_heads, err, errlen) ? 0 : -1;
}

void attn_mirror_detach(KVCache *c) {
    if (!c->device) return;
    mirror_free((AttnDevice *)c->device);
    c->device = NULL;
    c->on_slot = NULL;
    c->slot_ctx = NULL;
}

void attn_mirror_attend(KVCache *c, float *out, float *probs, int l, int t, const float *q) {
    mirror_attend((AttnDevice *)c->device, c, out, probs, l, t, q);
}

/* The mirror's k and v buffers on the host (copied back from the device), or NULL when the copy failed. */
static uint8_t *mirror_host_copy(const AttnDevice *d, const uint8_t *buf, size_t bytes) {
    uint8_t *h = (uint8_t *)xmalloc(bytes);
#ifdef __CUDACC__
    if (!d->on_host) {
        if (cudaMemcpy(h, buf, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) { free(h); return NULL; }
        return h;
    }
#endif
    (void)d;
    memcpy(h, buf, bytes);
    return h;
}

int attn_mirror_check_bytes(const KVCache *c, double key_tol, char *err, size_t errlen) {
    const AttnDevice *d = (const AttnDevice *)c->device;
    const Geo *g = &d->g;
    size_t kb = (size_t)g->n_lanes * ((size_t)g->Q * g->k_bytes + (size_t)g->R * g->hd * 4);
    size_t vb = (size_t)g->n_lanes * ((size_t)g->Q * g->v_bytes + (size_t)g->R * g->hd * 4);
    uint8_t *hk = mirror_host_copy(d, d->b.k, kb), *hv = mirror_host_copy(d, d->b.v, vb);
    int *hl = (int *)(void *)mirror_host_copy(d, (const uint8_t *)d->b.live, (size_t)g->n_lanes * g->budget * sizeof(int));
    int rc = 0;
    if (!hk || !hv || !hl) { snprintf(err, errlen, "cannot copy the mirror back"); rc = -1; }
    for (int lane = 0; lane < g->n_lanes && !rc; lane++) {
        const KVLane *ln = &c->lanes[lane];
        for (int i = 0; i < ln->n_live && !rc; i++) {
            int s = ln->live[i], ty;
            if (hl[(size_t)lane * g->budget + i] != s) {
                snprintf(err, errlen, "lane %d rank %d: live slot %d on the mirror, %d on the host", lane, i,
                         hl[(size_t)lane * g->budget + i], s);
                rc = -1;
                break;
            }
            for (int kv = 0; kv < 2 && !rc; kv++) {
                const uint8_t *base = kv ? hv : hk;
                int bytes = kv ? g->v_bytes : g->k_bytes;
                const uint8_t *m = slot_vec(base, g, lane, s, bytes, &ty, kv ? g->vtype : g->ktype);
                const uint8_t *h = kv ? kv_slot_v(c, ln, s) : kv_slot_k(c, ln, s);
                size_t n = s < g->Q ? (size_t)bytes : (size_t)g->hd * 4;
                if (kv == 0 && key_tol > 0 && memcmp(m, h, n)) {   /* keys within key_tol of the vector's max */
                    double mx = 0, e = 0;
                    int hty = s < g->Q ? g->ktype : KV_F32;
                    for (int x = 0; x < g->hd; x++) {
                        float a = load_elem(ty, m, x, g->hd), b = load_elem(hty, h, x, g->hd);
                        mx = fmax(mx, fabs(b));
                        e = fmax(e, fabs((double)a - b));
                    }
                    if (!(e <= key_tol * mx)) {
                        snprintf(err, errlen, "lane %d slot %d (rank %d): stored key differs by %.3g of its max (bound "
                                 "%.3g)", lane, s, i, e / mx, key_tol);
                        rc = -1;
                    }
                } else if (memcmp(m, h, n)) {
                    snprintf(err, errlen, "lane %d slot %d (rank %d, %s region): stored %s bytes differ from kv.c's",
                             lane, s, i, s < g->Q ? "typed" : "f32", kv ? "value" : "key");
                    rc = -1;
                }
            }
        }
    }
    free(hk); free(hv); free(hl);
    return rc;
}

int attn_mirror_check_sentinels(const KVCache *c, char *err, size_t errlen) {
    const AttnDevice *d = (const AttnDevice *)c->device;
    const Geo *g = &d->g;
    size_t rows = (size_t)d->launch_lanes * g->group;
    struct { const char *name; const void *p; size_t bytes; } bufs[] = {
        {"scores", d->b.scores, rows * g->budget * sizeof(float)},
        {"split results", d->b.part, (size_t)d->launch_lanes * d->max_splits * g->group * (g->hd + 2) * sizeof(float)},
        {"output", d->b.out, rows * g->hd * sizeof(float)},
        {"max and sum", d->b.ml, rows * 2 * sizeof(float)},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        uint8_t tail[ATTN_SENTINEL];
#ifdef __CUDACC__
        if (!d->on_host) {
            if (cudaMemcpy(tail, (const uint8_t *)bufs[i].p + bufs[i].bytes, ATTN_SENTINEL, cudaMemcpyDeviceToHost)
                != cudaSuccess) { snprintf(err, errlen, "cannot read the sentinel of %s", bufs[i].name); return -1; }
        } else
#endif
            memcpy(tail, (const uint8_t *)bufs[i].p + bufs[i].bytes, ATTN_SENTINEL);
        for (int b = 0; b < ATTN_SENTINEL; b++)
            if (tail[b] != 0xA5) {
                snprintf(err, errlen, "sentinel byte %d after the %s buffer was overwritten (0x%02x)", b, bufs[i].name, tail[b]);
                return -1;
            }
    }
    return 0;
}

void attn_encode_twin(uint8_t *dst, KVType ty, const float *x, int head_dim) {
    for (int u = 0; u < enc_units(ty, head_dim); u++) enc_unit(dst, ty, x, head_dim, u);
}

float attn_decode_elem_twin(KVType ty, const uint8_t *src, int e, int head_dim) { return load_elem(ty, src, e, head_dim); }

int attn_plan_twin(int head_dim, int group, int n_max, int launch_lanes, int *tps, int *chunk) {
    *tps = plan_tps(head_dim);
    if (!*tps) return -1;
    int ept = head_dim / *tps;
    if (chunk_max(group, head_dim, ept) < ATTN_CHUNK_MIN) return -1;
    *chunk = plan_chunk(n_max, launch_lanes, group, head_dim, ept, 132);
    return 0;
}

#ifdef __CUDACC__
/* ---------------------------------------------------------------------------------------------------------------
 * The device path (nvcc builds only).
 * ------------------------------------------------------------------------------------------------------------- */

int attn_cuda_usable(char *name, size_t name_len, char *why, size_t why_len) {
    int count = 0;
    if (name_len) name[0] = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) { snprintf(why, why_len, "no usable CUDA device (%s)", cudaGetErrorString(e)); return 0; }
    if (count < 1) { snprintf(why, why_len, "no CUDA device"); return 0; }
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, 0)) != cudaSuccess) {
        snprintf(why, why_len, "cannot query CUDA device 0 (%s)", cudaGetErrorString(e));
        return 0;
    }
    cudaFuncAttributes fa;
    if ((e = cudaFuncGetAttributes(&fa, attn_merge_kernel)) != cudaSuccess) {   /* no sm_90 code or PTX it can JIT */
        snprintf(why, why_len, "CUDA device 0 (%s, compute %d.%d) cannot run this build's kernels (%s)", p.name,
                 p.major, p.minor, cudaGetErrorString(e));
        cudaGetLastError();
        return 0;
    }
    snprintf(name, name_len, "%s", p.name);
    return 1;
}

int attn_dev_attach(KVCache *c, char *err, size_t errlen) {
    return mirror_new(c, 0, c->shape.n_kv_heads, err, errlen) ? 0 : -1;
}

void attn_dev_detach(KVCache *c) { attn_mirror_detach(c); }

void attn_dev_attend(KVCache *c, float *out, int l, int t, const float *q, int want_probs) {
    const KVPolicyOps *ops = c->policy.ops;
    int probs = want_probs || ops->observe || ops->prune || ops->on_layer_done;
    mirror_attend((AttnDevice *)c->device, c, out, probs ? c->scores : NULL, l, t, q);
    kv_attend_policy(c, l, t);
}

void attn_dev_describe(const KVCache *c, char *buf, size_t len) {
    const AttnDevice *d = (const AttnDevice *)c->device;
    if (!d || d->on_host) { snprintf(buf, len, "device cpu"); return; }
    snprintf(buf, len, "device cuda (%s): KV %.2f MiB in device memory + %.2f MiB workspace", d->name,
             d->cache_bytes / 1048576.0, (d->work_bytes + d->stage_cap) / 1048576.0);
}

size_t attn_dev_cache_bytes(const KVCache *c) { return c->device ? ((const AttnDevice *)c->device)->cache_bytes : 0; }
size_t attn_dev_work_bytes(const KVCache *c) {
    const AttnDevice *d = (const AttnDevice *)c->device;
    return d ? d->work_bytes + d->stage_cap : 0;
}

/* Benchmark fill: token (lane, slot) gets pseudo-random values in [-1, 1), encoded in its storage type. */
static __device__ float hash_unif(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return (float)((x >> 40) * (1.0 / 8388608.0)) - 1.0f;
}
__global__ void bench_fill_kernel(Bufs b, Geo g, uint64_t seed) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)g.n_lanes * g.Q) return;
    int lane = (int)(idx / g.Q), slot = (int)(idx % g.Q), ty;
    float x[512];
    for (int kv = 0; kv < 2; kv++) {
        for (int e = 0; e < g.hd; e++) x[e] = hash_unif(seed + ((idx * 2 + kv) * 1024 + e) * 0x9E3779B97F4A7C15ull);
        uint8_t *dst = (uint8_t *)slot_vec(kv ? b.v : b.k, &g, lane, slot, kv ? g.v_bytes : g.k_bytes, &ty,
                                           kv ? g.vtype : g.ktype);
        for (int u = 0; u < enc_units(ty, g.hd); u++) enc_unit(dst, ty, x, g.hd, u);
    }
    b.live[(size_t)lane * g.budget + slot] = slot;
}

static float median_of(float *v, int n) {
    for (int i = 1; i < n; i++) for (int j = i; j > 0 && v[j] < v[j - 1]; j--) { float t = v[j]; v[j] = v[j - 1]; v[j - 1] = t; }
    return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

/* Bytes of an L2-sized scratch written between repeats, so each repeat reads the cache from HBM. */
static void *l2_flush_buf(size_t *bytes) {
    int dev = 0, l2 = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
    *bytes = (size_t)(l2 > 0 ? l2 : 64 << 20) * 2;
    void *p = NULL;
    if (cudaMalloc(&p, *bytes) != cudaSuccess) return NULL;
    return p;
}

int attn_bench(const KVShape *shape, KVType ty, int n_tokens, int repeats, AttnBench *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    KVShape s = *shape;
    s.seq_len = n_tokens;
    KVSpec spec;
    char text[64];
    snprintf(text, sizeof text, "full,type=%s", kv_type_names[ty]);
    KVCache c;
    if (kv_spec_parse(&spec, text, KV_F32, err, errlen) || kv_cache_init(&c, &s, &spec, err, errlen)) return -1;
    AttnDevice *d = mirror_new(&c, 0, s.n_layers * s.n_kv_heads, err, errlen);
    if (!d) { kv_cache_free(&c); return -1; }
    const Geo *g = &d->g;
    int lanes = g->n_lanes, rows = lanes * g->group, rc = 0;
    size_t fb = 0;
    void *flush = l2_flush_buf(&fb);
    float *q_d = NULL, *cs_d = NULL, *ms = (float *)xmalloc((size_t)repeats * sizeof(float));
    int *nl_d = NULL;
    float *qh = (float *)xmalloc((size_t)rows * g->hd * sizeof(float)), *cs = (float *)xmalloc((size_t)g->hd * sizeof(float));
    int *nl = (int *)xmalloc((size_t)lanes * sizeof(int));
    uint64_t st = 12345;
    for (size_t i = 0; i < (size_t)rows * g->hd; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        qh[i] = (float)((st >> 40) * (1.0 / 8388608.0)) - 1.0f;
    }
    kv_rope_cs(cs, &s, n_tokens - 1);
    for (int j = 0; j < lanes; j++) nl[j] = n_tokens;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0); cudaEventCreate(&e1);
    if (!flush || cudaMalloc((void **)&q_d, (size_t)rows * g->hd * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&cs_d, (size_t)g->hd * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&nl_d, (size_t)lanes * sizeof(int)) != cudaSuccess) {
        snprintf(err, errlen, "out of device memory for the benchmark");
        rc = -1;
        goto done;
    }
    CK(cudaMemcpy(q_d, qh, (size_t)rows * g->hd * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cs_d, cs, (size_t)g->hd * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(nl_d, nl, (size_t)lanes * sizeof(int), cudaMemcpyHostToDevice));
    {
        size_t units = (size_t)lanes * g->Q;
        bench_fill_kernel<<<(unsigned)((units + 127) / 128), 128>>>(d->b, *g, 0x5eedull);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        Launch L;
        memset(&L, 0, sizeof L);
        L.g = *g; L.k = d->b.k; L.v = d->b.v; L.live = d->b.live; L.rope_rank = d->b.rope_rank;
        L.q = q_d; L.cs_q = cs_d; L.n_live = nl_d;
        L.scores = d->b.scores; L.part = d->b.part; L.out = d->b.out; L.ml = d->b.ml;
        L.lane0 = 0; L.n_lanes = lanes;
        L.chunk = plan_chunk(n_tokens, lanes, g->group, g->hd, g->ept, d->n_sm);
        L.max_splits = d->max_splits;
        L.grid_splits = (n_tokens + L.chunk - 1) / L.chunk;
        L.pitch = g->budget;
        /* validate before timing: outputs finite, each head's probabilities sum to 1 */
        launch_attention(&L, 1, 0);
        CK(cudaDeviceSynchronize());
        float *oh = (float *)xmalloc((size_t)rows * g->hd * sizeof(float)), *ph = (float *)xmalloc((size_t)n_tokens * sizeof(float));
        CK(cudaMemcpy(oh, d->b.out, (size_t)rows * g->hd * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < (size_t)rows * g->hd; i++) if (!isfinite(oh[i])) { r->bad = 1; break; }
        for (int row = 0; row < rows; row += rows - 1 > 0 ? rows - 1 : 1) {
            CK(cudaMemcpy(ph, d->b.scores + (size_t)row * g->budget, (size_t)n_tokens * sizeof(float), cudaMemcpyDeviceToHost));
            double sum = 0;
            for (int i = 0; i < n_tokens; i++) sum += ph[i];
            if (!(fabs(sum - 1.0) <= 1e-3)) r->bad = 1;
            if (rows == 1) break;
        }
        free(oh); free(ph);
        for (int it = 0; it < repeats; it++) {
            CK(cudaMemsetAsync(flush, it & 0xff, fb, 0));
            CK(cudaEventRecord(e0, 0));
            launch_attention(&L, 0, 0);
            CK(cudaEventRecord(e1, 0));
            CK(cudaEventSynchronize(e1));
            CK(cudaEventElapsedTime(&ms[it], e0, e1));
        }
        r->bytes = (double)lanes * n_tokens * (g->k_bytes + g->v_bytes);
        r->ms_median = median_of(ms, repeats);
        r->ms_min = ms[0];
        r->gbps = r->bytes / (r->ms_median * 1e-3) / 1e9;
        r->chunk = L.chunk;
        r->splits = L.grid_splits;
        r->lanes = lanes;
    }
done:
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    if (flush) cudaFree(flush);
    if (q_d) cudaFree(q_d);
    if (cs_d) cudaFree(cs_d);
    if (nl_d) cudaFree(nl_d);
    free(ms); free(qh); free(cs); free(nl);
    attn_mirror_detach(&c);
    kv_cache_free(&c);
    return rc;
}

int attn_bench_copy(size_t bytes, int repeats, double *gbps, double *ms_median, char *err, size_t errlen) {
    void *a = NULL, *b = NULL;
    size_t fb = 0;
    void *flush = l2_flush_buf(&fb);
    if (!flush || cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        snprintf(err, errlen, "out of device memory for the copy benchmark (%zu bytes)", bytes);
        if (a) cudaFree(a);
        if (flush) cudaFree(flush);
        return -1;
    }
    CK(cudaMemset(a, 1, bytes));
    float *ms = (float *)xmalloc((size_t)repeats * sizeof(float));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (int it = 0; it < repeats; it++) {
        CK(cudaMemsetAsync(flush, it & 0xff, fb, 0));
        CK(cudaEventRecord(e0, 0));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms[it], e0, e1));
    }
    *ms_median = median_of(ms, repeats);
    *gbps = 2.0 * (double)bytes / (*ms_median * 1e-3) / 1e9;   /* bytes read + bytes written */
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaFree(a); cudaFree(b); cudaFree(flush);
    free(ms);
    return 0;
}
#endif /* __CUDACC__ */
