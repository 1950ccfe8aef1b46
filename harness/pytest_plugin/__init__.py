"""The harness as a pytest plugin: `plugin` is the pytest11 entry point and loads the rest.

| module | what |
|---|---|
| `collection` | options (`--mrh-*`), markers, device variants, keeping CUDA variants out unless `-m` selects `gpu` |
| `parametrize` | `device` / `layouts` / `layout_pairs` parametrization, the machine's CUDA layouts |
| `worlds` | `world_pool`, `world`, `fresh_world`; skipping tests whose world does not fit |
| `reporting` | the run report (results.json, rendered at session end), `report`, `report_dir`, xdist |
| `workers` | `policy`, `reference`: resident training workers on the persistent worlds; `rl_loop`: a GRPO loop |
"""
