"""Structured output, the scheduler's side: grammars compiled from a request's constraint
(:mod:`forerun.structured_params`, the value type), advanced by each accepted token, and
the bitmask of allowed tokens for every step."""
