"""Ampere-generation kernels (mma.sync, cp.async, ldmatrix); they also run on Hopper."""
