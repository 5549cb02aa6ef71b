"""Launch-wide tile counters (fmha_ops/kernels/tile_counter.py): one zeroed int32 pair per (device, stream), kept
between calls, a fresh one under CUDA-graph capture of a stream without one. The kernel side (the last CTA resets
the pair): ``test_gpu_gluon_ws_dynamic_tiles`` in test_kernel_gluon_fwd.py."""
import pytest
import torch

from fmha_ops.kernels.tile_counter import COUNTER_WORDS, tile_counters


def test_tile_counters_are_a_zeroed_int32_pair_kept_per_device():
    pair = tile_counters(torch.device("cpu"))
    assert pair.dtype == torch.int32 and pair.shape == (COUNTER_WORDS,) and pair.eq(0).all()
    assert tile_counters("cpu") is pair


@pytest.mark.gpu
def test_gpu_tile_counters_per_stream_and_fresh_under_capture():
    """Streams that may run kernels at once get pairs of their own; a stream capturing a graph without a pair gets
    a fresh one that is not kept; one with a pair keeps using it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    main = tile_counters(dev)
    assert tile_counters(torch.device("cuda")) is main and main.device == dev
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kept = tile_counters(dev)
    assert kept is not main and kept.data_ptr() != main.data_ptr()
    fresh_stream = torch.cuda.Stream()
    for stream, expect_kept in ((side, True), (fresh_stream, False)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = tile_counters(dev)
        assert (captured is kept) == expect_kept
    with torch.cuda.stream(fresh_stream):
        assert tile_counters(dev) is not captured  # made outside a capture: kept from now on
