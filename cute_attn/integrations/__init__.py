"""torch and ecosystem integration above the entry points: custom ops for torch.compile
(``custom_ops``), SDPA's flash backend (``sdpa``), Hugging Face transformers (``transformers``)."""
