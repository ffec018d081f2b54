"""Hugging Face checkpoints in and out (GPT-2 and Llama), checked by `transformers` in the tests.

    python scripts/convert.py --from_hf=DIR --run_dir=RUN [--config=PRESET] [--mesh.tensor=2 ...]
    python scripts/convert.py --to_hf --run_dir=RUN --out=DIR [--dtype=bfloat16] [--mesh.data=1 ...]

--from_hf reads a local model directory (config.json, safetensors, tokenizer.json when present; e.g. from
`huggingface-cli download gpt2 --local-dir DIR`) into a new run directory with a verified checkpoint of step 0 and
a config that `scripts/train.py --config=RUN --resume` continues (on any mesh) and `scripts/generate.py --run_dir=RUN`
decodes. The model section comes from config.json; --config (a preset or file) gives the training settings, and
config flags override both. --to_hf writes the run's newest verified checkpoint as a directory that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.
"""

import dataclasses
import json
import sys

from msjax import cli, runtime
from msjax.config import ConfigError, load_preset

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """Conversion flags.

    Attributes:
      from_hf: a local Hugging Face model directory to import into --run_dir.
      to_hf: write --run_dir's newest verified checkpoint to --out as a Hugging Face model directory.
      run_dir: the msjax run directory (created by --from_hf; read by --to_hf).
      out: the Hugging Face directory --to_hf creates.
      dtype: the dtype of the tensors --to_hf writes (float32 is exact; bfloat16 halves the size).
      max_shard_mb: --to_hf writes safetensors shards of at most this many MiB (with an index when several).
    """

    from_hf: str = ""
    to_hf: bool = False
    run_dir: str = ""
    out: str = ""
    dtype: str = "float32"
    max_shard_mb: int = 2048


def _flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            return argv[i + 1]
    return ""


def _config_flags(argv: list[str]) -> dict[str, str]:
    """The dotted config flags on the command line (`--mesh.tensor=2`, `--mesh.tensor 2`, a bare boolean), as
    given; later ones win."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and "." in key:
            if not eq:
                has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                value = argv[i + 1] if has_value else "true"
                i += has_value
            out[key] = value
        i += 1
    return out


def main(argv: list[str]) -> int:
    def body() -> int:
        run_dir = _flag(argv, "run_dir")
        exporting = "--to_hf" in argv or any(a.startswith("--to_hf=") and a != "--to_hf=false" for a in argv)
        if exporting == bool(_flag(argv, "from_hf")) and "--help" not in argv:
            raise ConfigError("give exactly one of --from_hf=DIR (import) and --to_hf (export)")
        # --to_hf: the run's own config.json gives every config flag its default (flags lay it out on a mesh).
        default = f"{run_dir}/config.json" if exporting and run_dir else "gpt_tiny"
        cfg, (common, opts) = cli.parse(argv, ConvertOptions(), prog="convert.py", description=__doc__,
                                        default_preset=default, validate=False)
        cli.setup_logging(common)
        if not opts.run_dir:
            raise ConfigError("--run_dir is required")
        from msjax.hf import export_hf, import_hf

        if opts.to_hf:
            if not opts.out:
                raise ConfigError("--to_hf needs --out=DIR, the directory to write")
            if opts.max_shard_mb < 1:
                raise ConfigError(f"--max_shard_mb={opts.max_shard_mb}: allowed is an integer >= 1")
            result = export_hf(opts.run_dir, opts.out, dtype=opts.dtype, max_shard_bytes=opts.max_shard_mb << 20,
                               config=cfg.validate())
            print(json.dumps({"out": str(result.out_dir), "architecture": result.arch, "step": result.step,
                              "files": result.files, "seconds": round(result.seconds, 2)}))
            return 0
        # Import: the model comes from config.json, the training settings from --config (msjax's defaults when
        # none is named), and the config flags given override both.
        named = any(a == "--config" or a.startswith("--config=") for a in argv)
        result = import_hf(opts.from_hf, opts.run_dir, base=load_preset(common.config) if named else None,
                           overrides=_config_flags(argv))
        print(json.dumps({"run_dir": str(result.run_dir), "architecture": result.arch,
                          "param_count": result.param_count, "seconds": round(result.seconds, 2)}))
        return 0

    from msjax.checkpoint import CheckpointError

    try:
        return cli.main_guard(body)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
