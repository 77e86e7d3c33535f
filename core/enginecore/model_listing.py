"""What ``enginecore models`` prints and ``docs/models.md`` holds: the registered model
architectures, the plugin that provides each, and the features each declares."""

from __future__ import annotations

from typing import Any

# The feature vocabulary of ``register_models`` (``registry.add(..., features=...)``),
# in column order, with the heading each gets.
MODEL_FEATURES = {
    "sliding_window": "sliding window",
    "moe": "MoE",
    "gguf": "GGUF",
    "tp": "TP",
    "pp": "PP",
}

DOC_HEADER = """# Model architectures

Generated from the model registry by `enginecore models --markdown` (built-in plugins
only); `tests/models/test_models_listing.py` checks that this page matches it. Run
`enginecore models` to see what is registered in your installation, plugins included.

Each architecture is the name in a checkpoint's `config.json` `architectures` list.
Features: **sliding window** (layers that attend to the last W positions and keep only
those W in the KV cache), **MoE**
(mixture of experts: tokens grouped by expert, one GEMM pair per expert per step),
**GGUF** (loads from a `.gguf` file), **TP** / **PP** (tensor / pipeline parallelism).

Checkpoints that need what enginecore does not implement are refused at load with the
model and the feature named: a `quantization_config` other than 4-bit AWQ / GPTQ (FP8, bitsandbytes...),
a GGUF tensor type that cannot be de-quantized, a `rope_scaling` type other than
`default`, `linear`, `llama3`, `yarn`, `dynamic` and `longrope`, or an unknown activation.

"""


def model_rows(host: Any) -> list[dict[str, Any]]:
    """One row per registered architecture, sorted by name."""
    registry = host.registry("model")
    rows = []
    for name in registry.names():
        entry = registry.entry(name)
        record = host.records.get(entry.plugin)
        rows.append(
            {
                "architecture": name,
                "plugin": entry.plugin,
                "builtin": bool(record.builtin) if record is not None else False,
                "summary": entry.summary,
                "features": [f for f in MODEL_FEATURES if f in entry.features]
                + [f for f in entry.features if f not in MODEL_FEATURES],
                "class": entry.ref,
            }
        )
    return rows


def render_text(rows: list[dict[str, Any]]) -> str:
    width = max((len(r["architecture"]) for r in rows), default=0)
    lines = []
    for r in rows:
        features = ", ".join(MODEL_FEATURES.get(f, f) for f in r["features"]) or "-"
        lines.append(f"{r['architecture']:<{width}}  [{r['plugin']}]  {features}")
        if r["summary"]:
            lines.append(f"{'':<{width}}  {r['summary']}")
    return "\n".join(lines)


def render_markdown(rows: list[dict[str, Any]]) -> str:
    heads = ["architecture", "plugin", *MODEL_FEATURES.values(), "notes"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        marks = ["yes" if f in r["features"] else "" for f in MODEL_FEATURES]
        cells = [f"`{r['architecture']}`", r["plugin"], *marks, r["summary"]]
        lines.append("| " + " | ".join(cells) + " |")
    return DOC_HEADER + "\n".join(lines) + "\n"
