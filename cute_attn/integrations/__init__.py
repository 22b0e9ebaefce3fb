"""cute_attn where models already call attention: SDPA's flash backend (``sdpa``)."""
