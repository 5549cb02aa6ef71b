"""Gluon (triton.experimental.gluon) kernels: explicit async wgmma, TMA rings, mbarriers (Hopper sm90)."""
