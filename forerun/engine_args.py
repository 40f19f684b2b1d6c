"""Engine command-line flags shared by ``forerun serve``, ``generate`` and ``chat``.

Every flag is derived from a field of :class:`forerun.config.EngineConfig` (its name in
vLLM's spelling, ``--max-num-seqs`` for ``max_num_seqs``; its help text, type and default),
so a new field is a new flag and the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Any

from forerun import envs
from forerun.config import EngineConfig

_TYPES: dict[type, Any] = {int: int, float: float, str: str}


def _value_type(hint: Any) -> type:
    """``int`` for ``int | None`` and so on: the one non-None type of a field."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def engine_fields() -> list[Field]:
    """The EngineConfig fields that are command-line flags (all of them)."""
    return [f for f in fields(EngineConfig) if "help" in f.metadata]


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EngineConfig flags (vLLM's spellings) to ``parser``."""
    g = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_fields():
        meta = f.metadata
        names = [f"--{f.name.replace('_', '-')}", *([meta["short"]] if "short" in meta else [])]
        default = None if f.default is MISSING else f.default
        kind = _value_type(hints[f.name])
        if "choices" in meta:
            g.add_argument(*names, choices=list(meta["choices"]), default=default,
                           help=meta["help"])
        elif kind is bool:
            g.add_argument(*names, action=argparse.BooleanOptionalAction, default=default,
                           help=meta["help"])
        else:
            parse = meta.get("parse") or _TYPES.get(kind, str)
            g.add_argument(*names, type=parse, default=default, help=meta["help"])
        if "negative" in meta:
            g.add_argument(meta["negative"], dest=f.name, action="store_const",
                           const="off", help=f"same as --{f.name.replace('_', '-')} off")
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from parsed ``add_engine_args`` flags; ValueError if invalid.

    Under a launcher that starts one process per rank (``torchrun``: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) with tensor x pipeline parallel size equal to WORLD_SIZE and no
    ``--nnodes``, each process is one "node" of one rank: RANK 0 runs the engine.
    """
    launched = envs.launcher_rank()
    if (launched is not None and launched[1] > 1 and args.nnodes == 1
            and args.tensor_parallel_size * args.pipeline_parallel_size == launched[1]):
        args.node_rank, args.nnodes = launched
    return EngineConfig(**{f.name: getattr(args, f.name) for f in engine_fields()})
