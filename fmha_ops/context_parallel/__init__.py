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

  Compute per step: causal zigzag, one chunk x two chunks on every rank at every step (the first: the causal
  two x two); not causal, two x two. Causal forward flops per step and rank::

      flops = 2 * B * Hq * (N/W)^2 * D            (backward: 2.5x)

  Overlap hides the transfer when it is shorter than the step, at link bandwidth BW and attention rate F::

      t_comm = 2 * (N/W) * Hkv * D * elt / BW     t_step = 2 * B * Hq * (N/W)^2 * D / F
      t_comm < t_step  <=>  N/W > Hkv * elt * F / (B * Hq * BW)

  Backward: the bytes are (elt + 4) / elt times the forward's (float32 dK/dV) against 2.5x the compute.

  Example: B=1, Hq=32, Hkv=8, D=128, bf16 (elt 2), F ~ 450 TFLOP/s (an H200's bf16 forward), BW ~ 350 GB/s
  per direction (NVLink, 450 GB/s peak). N = 128k on W=2: 268 MB per step, 0.77 ms on the link, against
  78 ms of attention: the transfer is 1% of a step. The break-even N/W is 8 * 2 * 450e12 / (32 * 350e9)
  ~ 640 tokens per rank (backward, at F ~ 400: ~ 690; without GQA 4x more), so at N = 128k the links stay
  hidden up to W ~ 190. Long before that the host binds: each step is one or two partial-attention calls (~0.1 ms of
  host time each) and a merge, while the step's attention at N/W = 4k tokens is ~0.3 ms; keep N/W >= 8k
  tokens per rank (W <= 16 at 128k) or capture the step loop in a CUDA graph.
  On N GPUs nothing else changes: no collective, one send and one receive per rank per step, every link
  carries one K/V shard per step; (W - 1) * kv_bytes per rank per forward, W-1 K/V + W dK/dV backward.

Public functions
  attention                       the ring attention (autograd)
  shard, unshard, shard_cu_seqlens, chunk_ids  layout helpers
  partial_attention_backward      gradients of one key slice given the merged out / lse (any process)
"""
from .attention import attention
from .layout import LAYOUTS, chunk_ids, shard, shard_cu_seqlens, unshard
from .steps import partial_attention_backward

__all__ = ["attention", "shard", "unshard", "shard_cu_seqlens", "chunk_ids", "partial_attention_backward", "LAYOUTS"]
