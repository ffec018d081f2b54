"""Train a GPT: `python scripts/train.py --config=gpt_tiny [--train.steps=200 --mesh.tensor=2 ... --resume]`.

Flags -> config -> msjax.train.run. Every field of msjax/config.py is a dotted flag; presets live in configs/.
"""

import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.config import ConfigError, parse_args  # noqa: E402
from msjax.data import DataError  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        cfg, rest = parse_args(argv)
        if rest:
            raise ConfigError(f"unexpected arguments {rest}; flags look like --train.steps=100")
        from msjax import distributed
        from msjax.parallel import xla_flags
        from msjax.train import run, summary_json

        xla_flags.apply(cfg.mesh.tp_overlap)  # before the backend starts: XLA reads XLA_FLAGS once
        distributed.initialize()
        summary = run(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = summary_json(summary)
    out.pop("sample", None)
    if jax.process_index() == 0:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
