"""Hopper (SM90) kernels: wgmma, TMA, warp specialisation."""
