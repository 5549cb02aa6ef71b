"""Context-parallel (ring) attention: a sequence split across the ranks of a process group.

Each of W ranks holds a shard of every sequence and gets its shard of the output; key/value shards move
around the ring (rank i sends to i + 1, receives from i - 1) while each rank attends the shard in hand,
and partial results are merged by their log-sum-exp in float32.

    from fmha_ops import context_parallel as cp
    q_i, k_i, v_i = (cp.shard(t, rank, world, "zigzag") for t in (q, k, v))   # (B, N/W, H, K)
    out_i = cp.attention(q_i, k_i, v_i, causal=True, group=pg)              # (B, N/W, Hq, Kv)
    out_i.backward(grad_i)                                                   # grads of q_i, k_i, v_i

Layouts (``layout=``; ``shard`` / ``unshard`` / ``shard_cu_seqlens`` convert)
  "zigzag"      the sequence in 2W equal chunks, rank i holds chunks i and 2W-1-i (in that order). Causal
                work is the same on every rank at every step (``schedule``): N must be a multiple of 2W.
  "contiguous"  W chunks, rank i holds chunk i. Causal work is unbalanced (rank W-1 does W blocks, rank 0
                one), so the ring runs at the pace of the last rank; N must be a multiple of W.
  Varlen (``cu_seqlens``, batch 1): each packed sequence is sharded this way on its own, so every rank holds
  len / W tokens of every sequence, in sequence order; ``shard_cu_seqlens`` gives the shard's starts.

Shapes and dtypes
  q (B, N/W, Hq, K), k (B, N/W, Hkv, K), v (B, N/W, Hkv, Kv), Hq % Hkv == 0 (GQA/MQA); float16, bfloat16,
  float32, or fp8 e4m3 with float32 descales per tensor or per (batch, kv head) (k/v descales travel with
  their shards). Output (B, N/W, Hq, Kv) in q's dtype (bfloat16 for fp8); the optional LSE (B, Hq, N/W)
  float32. Each block's partial attention is written in q's dtype (float16/bfloat16) or float32, and
  merged into float32 accumulators.

Steps and communication (per rank, per step; W steps forward, W steps backward)
  Forward, step s: attend the key/value shard of rank i - s (1 or 2 partial-attention calls), while the
  send of that shard to rank i + 1 and the receive of the next are in flight (``ring``: one message
  each way, issued on a side stream on CUDA; W - 1 transfers in all). Bytes sent per step::

      kv_bytes = 2 * (N / W) * Hkv * D * elt      (+ descales; elt = 2 for bf16, 1 for fp8)

  Backward, step s: the key/value shard moves as in the forward, and the float32 dK/dV of the shard in
  hand (the sum of the ranks that saw it before) follows it one step behind: 2 * (N / W) * Hkv * D * 4 more
  bytes per step, W transfers. dQ stays local.

  Compute per step (causal zigzag: one chunk x two chunks, half of a W x W grid's full block):
  flops = 4 * B * Hq * (N / W)^2 * D / 2 forward (x 2.5 backward). Overlap hides the transfer when
  kv_bytes / link_bandwidth < step time, i.e. when N / W is large enough::

      t_comm = 2 * (N/W) * Hkv * D * elt / BW        t_step = 2 * B * Hq * (N/W)^2 * D / F
      t_comm < t_step  <=>  N / W > Hkv * elt * F / (B * Hq * BW)

  Example, H200 NVLink (BW ~ 350 GB/s per direction achieved of 450), bf16 forward F ~ 450 TFLOP/s,
  Hq = Hkv (worst case: no GQA): N / W > 2 * 450e12 / 350e9 ~ 2600 tokens per rank; fp8 (elt 1, F ~ 800)
  about the same. At 128k tokens on 2 GPUs a step is 64k x 32k... per head: transfers are ~20x smaller
  than compute, so W up to ~16 (8k tokens per rank) keeps the links idle half the time. Past the break-even
  the ring is link-bound: then lower W, use GQA (Hkv < Hq divides the bytes) or fp8 K/V.
  On N GPUs the ring needs no collective: each step is one send and one receive per rank, so every link
  carries one K/V shard per step regardless of W; total bytes per rank per pass = (W - 1) * kv_bytes.

Public functions
  attention                       the ring attention (autograd)
  shard, unshard, shard_cu_seqlens, chunk_ids  layout helpers
  partial_attention_backward      gradients of one key slice given the merged out / lse (any process)
"""
from .attention import attention
from .layout import LAYOUTS, chunk_ids, shard, shard_cu_seqlens, unshard
from .steps import partial_attention_backward

__all__ = ["attention", "shard", "unshard", "shard_cu_seqlens", "chunk_ids", "partial_attention_backward", "LAYOUTS"]
