"""Launch-wide tile counters (fmha_ops/kernels/tile_counter.py): one zeroed int32 pair per (device, stream), kept
between calls, a fresh one for each call under CUDA-graph capture. The kernel side (the last CTA resets
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
    """Streams that may run kernels at once get pairs of their own; each call under graph capture gets a fresh pair
    that is not kept, so graphs share counters with nothing."""
    dev = torch.device("cuda", torch.cuda.current_device())
    main = tile_counters(dev)
    assert tile_counters(torch.device("cuda")) is main and main.device == dev
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kept = tile_counters(dev)
    assert kept is not main and kept.data_ptr() != main.data_ptr()
    fresh_stream = torch.cuda.Stream()
    for stream in (side, fresh_stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = tile_counters(dev)
            again = tile_counters(dev)
        assert captured is not kept and again is not captured
    with torch.cuda.stream(fresh_stream):
        made = tile_counters(dev)  # made outside a capture: kept from now on
        assert made is not captured and tile_counters(dev) is made
