"""``prepare(compile=True)`` and ``amp="bf16"`` against the default, one epoch each,
interleaved after a warm-up epoch (which pays torch.compile's compilation).

    python benchmarks/bench_compile_amp.py [--repeats 3] [--samples 12800]
"""

from __future__ import annotations

from common import BATCH, interleave, lenet_and_adam, setup, table, timed
from torch import nn

from hapi import Model


def main() -> None:
    repeats, data = setup(3)
    models = {}
    compile_seconds = {}
    for name, options in {
        "default": {},
        "amp='bf16'": {"amp": "bf16"},
        "compile=True": {"compile": True},
    }.items():
        network, optimizer = lenet_and_adam()
        model = Model(network)
        model.prepare(optimizer, nn.CrossEntropyLoss(), **options)
        compile_seconds[name] = timed(
            lambda: model.fit(data, batch_size=BATCH, verbose=0, num_iters=3)
        )
        models[name] = model
    runs = {
        name: (lambda m=model: m.fit(data, batch_size=BATCH, epochs=1, verbose=0))
        for name, model in models.items()
    }
    print(
        table(
            interleave(runs, repeats),
            "default",
            f"compile and bf16: one epoch, {len(data)} images, batch {BATCH}",
        )
    )
    print(
        "\nfirst 3 steps (includes compilation): "
        + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in compile_seconds.items())
    )


if __name__ == "__main__":
    main()
