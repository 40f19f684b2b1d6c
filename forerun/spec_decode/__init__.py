"""Speculative decoding without a draft model: drafters that guess from text already seen.

The drafter runs on the worker right after sampling, where the new tokens are; the
scheduler only ever learns *how many* drafts a request has, never their ids.
"""

from forerun.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
