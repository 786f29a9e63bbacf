"""What the generators share: each kernel is a WGSL template beside its
generator (NAME.wgsl.in), readable as WGSL, with {{PART}} where the
generator puts the statements it unrolls. The output goes to
shaders/tiled/ (decoding's to shaders/decode/), which the host embeds
(src/gpu/shaders.rs)."""

import re
from pathlib import Path

HERE = Path(__file__).parent
# The register tiles are 4x4: rows i and streamed rows (or keys) j < 4.
R = range(4)
# Registers of a prefetched tile each invocation holds: at most 8 (PF_N).
PF = range(8)


def indent(text, n):
    return "\n".join((" " * n + line) if line else line for line in text.split("\n"))


def fill(template, parts):
    """The text of template `template` with every {{PART}} replaced; a part
    the template lacks, or a placeholder left over, is an error."""
    text = (HERE / template).read_text()
    for name, value in parts.items():
        key = "{{" + name + "}}"
        if key not in text:
            raise KeyError(f"{template} has no {key}")
        text = text.replace(key, value)
    left = re.findall(r"\{\{\w+\}\}", text)
    if left:
        raise KeyError(f"{template}: nothing fills {left}")
    return text


def write(name, text, folder="tiled"):
    out = HERE.parent / folder
    out.mkdir(exist_ok=True)
    (out / name).write_text(text)
