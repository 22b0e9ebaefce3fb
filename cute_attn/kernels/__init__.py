"""CuTe DSL kernels.

Shared building blocks live at this level (``layout``, ``softmax``, ``mask``, ``block_info``);
each architecture has its own package (``sm80``, ``sm90``) with one kernel class per file.
Nothing here imports torch: kernels see only CuTe tensors.
"""
