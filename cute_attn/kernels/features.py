"""The optional attention features a kernel is compiled with (part of every compile key).

Each one changes the inner loop, so it is a compile-time flag: a kernel without it carries none of
its code. Their run-time values (window edges, the softcap, the ALiBi slopes, cu_seqlens) are
kernel arguments, so a new value never compiles.

- ``local``: a sliding window (window_left, window_right) in FlashAttention's bottom-right aligned
  sense; causal attention with a left window is local with window_right = 0.
- ``softcap``: scores = softcap * tanh(scores / softcap) (mask.apply_softcap).
- ``alibi``: the bias -slope * |i + seqlen_k - seqlen_q - j| per head (and batch).
- ``varlen``: packed sequences delimited by cu_seqlens_q / cu_seqlens_k (seqlen_info).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Features:
    local: bool = False
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False

    @property
    def suffix(self) -> str:
        """For kernel names: '_local_softcap', '' when none."""
        return "".join(f"_{name}" for name in ("local", "softcap", "alibi", "varlen") if getattr(self, name))


NO_FEATURES = Features()


def parse_features(spec: str) -> Features:
    """'none' or names joined by commas ('local,softcap'): the command-line form of the tools."""
    names = [n for n in spec.split(",") if n and n != "none"]
    unknown = set(names) - {"local", "softcap", "alibi", "varlen"}
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}: choose from local, softcap, alibi, varlen, none")
    return Features(**{n: True for n in names})
