"""Named presets: each module holds `OVERRIDES`, the dotted keys that differ from `msjax.config` defaults.

Load one with `msjax.config.load_preset(name)` or `--config=NAME` on the command line.
"""
