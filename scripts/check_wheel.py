"""Checks a Linux wheel of flashport before anyone installs it (`make test-wheel`).

    check_wheel.py --policy manylinux2014 WHEEL     exit 1 and say why unless WHEEL:
      - is tagged, in its name and in its WHEEL file, with the policy and nothing newer
        (manylinux2014 is the legacy name of manylinux_2_17);
      - is, by `auditwheel show`'s reading of its ELF files, consistent with that policy:
        no glibc symbol newer than the policy allows, no shared library outside the
        policy's whitelist;
      - holds one extension module and no bundled library (no `flashport.libs/`), and
        the extension does not link the Vulkan loader: wgpu opens libvulkan.so.1 at run
        time (dlopen), so a machine without one still imports flashport and computes on
        the CPU, and a machine with one uses its own, matched to its drivers.
    check_wheel.py --policy manylinux2014 --self-test WHEEL
      checks WHEEL, then that the check rejects, each for its own reason, copies of
      WHEEL made wrong in the ways above: retagged manylinux_2_35 (today's tag when
      built on Debian 12 without zig), an extension that needs glibc 2.35 (the same
      fault in the binary), one that links libvulkan.so.1, one bundled loader. The stub
      extensions are compiled by zig (the `ziglang` package of requirements-dev.txt).

Needs auditwheel (pinned in requirements-dev.txt) next to this Python.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

# PEP 600's names for the PEP 599 policy; auditwheel reports the new names.
LEGACY = {"manylinux2014": "manylinux_2_17", "manylinux2010": "manylinux_2_12"}
MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_(\w+)$")
VULKAN_LOADER = re.compile(r"(^|/)libvulkan[^/]*\.so")
EXTENSION = re.compile(r"^flashport/_core\.abi3\.so$")


def policy_name(policy: str) -> str:
    return LEGACY.get(policy, policy)


def glibc_of(tag: str) -> tuple[int, int] | None:
    """(2, 17) for manylinux_2_17_x86_64 or manylinux2014_x86_64; None for linux_*."""
    for legacy, name in LEGACY.items():
        if tag.startswith(legacy + "_"):
            tag = name + tag[len(legacy) :]
    match = MANYLINUX.match(tag)
    return (int(match[1]), int(match[2])) if match else None


def platform_tags(wheel: Path) -> list[str]:
    # name-version-python-abi-platform.whl; compressed tag sets are dot-separated.
    return wheel.name.removesuffix(".whl").split("-")[-1].split(".")


def architecture(wheel: Path) -> str:
    return re.sub(r"^(manylinux\d+|manylinux_\d+_\d+|linux)_", "", platform_tags(wheel)[0])


def wheel_file_tags(archive: zipfile.ZipFile) -> set[str]:
    [info] = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/WHEEL", n)]
    text = archive.read(info).decode()
    return {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")}


def needed_libraries(data: bytes) -> list[str]:
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        elf = ELFFile(f)
        return [
            tag.needed
            for section in elf.iter_sections()
            if isinstance(section, DynamicSection)
            for tag in section.iter_tags()
            if tag.entry.d_tag == "DT_NEEDED"
        ]


def auditwheel_show(wheel: Path) -> dict:
    auditwheel = Path(sys.executable).with_name("auditwheel")
    result = subprocess.run(
        [str(auditwheel), "show", "--json", str(wheel)], capture_output=True, text=True
    )
    if result.returncode != 0:
        return {"error": (result.stderr or result.stdout).strip()}
    return json.loads(result.stdout)


def problems(wheel: Path, policy: str) -> list[tuple[str, str]]:
    """Each fault as (kind, message); empty when the wheel is fit to publish."""
    want = glibc_of(policy_name(policy) + "_any")
    assert want, f"not a manylinux policy: {policy}"
    found: list[tuple[str, str]] = []

    tags = platform_tags(wheel)
    for tag in tags:
        have = glibc_of(tag)
        if have is None or have > want:
            found.append(("tag", f"tagged {tag}: pip refuses it on glibc older than {policy}'s"))
    with zipfile.ZipFile(wheel) as archive:
        declared = {t.split("-")[-1] for t in wheel_file_tags(archive)}
        if declared != set(tags):
            found.append(("tag", f"WHEEL says {sorted(declared)}, the file name {sorted(tags)}"))
        names = archive.namelist()
        libraries = [n for n in names if re.search(r"\.so(\.|$)", n)]
        for name in libraries:
            if VULKAN_LOADER.search(name):
                found.append(("bundled", f"bundles the Vulkan loader: {name}"))
            elif not EXTENSION.match(name):
                found.append(("bundled", f"bundles a shared library: {name}"))
        if not any(EXTENSION.match(n) for n in names):
            found.append(("contents", "no flashport/_core.abi3.so"))
        for name in libraries:
            for needed in needed_libraries(archive.read(name)):
                if VULKAN_LOADER.search(needed):
                    found.append(("vulkan", f"{name} links {needed} instead of opening it"))

    report = auditwheel_show(wheel)
    if "error" in report:
        found.append(("auditwheel", f"auditwheel show failed: {report['error']}"))
        return found
    overall = report["overall_tag"]
    have = glibc_of(overall)
    if have is None or have > want:
        # Why, as auditwheel reads it: libraries outside the policy's whitelist,
        # glibc symbols newer than the policy's glibc.
        too_new = sorted(
            f"{symbol} ({lib})"
            for lib, symbols in report["versioned_symbols"].items()
            for symbol in symbols
            if symbol.startswith("GLIBC_") and _version(symbol)[:2] > want
        )
        found.append(
            (
                "auditwheel",
                f"auditwheel: consistent only with {overall}; libraries outside "
                f"{policy}'s whitelist: {sorted(report['external_libs']) or 'none'}; "
                f"symbols newer than glibc {want[0]}.{want[1]}: {too_new or 'none'}",
            )
        )
    return found


def check(wheel: Path, policy: str) -> bool:
    found = problems(wheel, policy)
    for _, message in found:
        print(f"check_wheel: {wheel.name}: {message}", file=sys.stderr)
    if not found:
        print(
            f"check_wheel: {wheel.name}: {policy} by its tags and by auditwheel show, "
            "no library outside the whitelist, none bundled, the Vulkan loader not linked"
        )
    return not found


def _version(symbol: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", symbol))


# --- the self-test: wheels made wrong on purpose --------------------------------


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def rewrite(
    wheel: Path, out_dir: Path, tag: str | None = None, files: dict[str, bytes] | None = None
) -> Path:
    """A copy of WHEEL with its platform tag replaced by TAG and FILES put in
    (replaced or added), its RECORD recomputed, so that only the fault differs."""
    files = files or {}
    name = wheel.name
    if tag:
        stem = name.removesuffix(".whl").split("-")
        name = "-".join([*stem[:-1], tag]) + ".whl"
    out = out_dir / name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        contents = {n: src.read(n) for n in src.namelist()}
        [wheel_info] = [n for n in contents if n.endswith(".dist-info/WHEEL")]
        [record] = [n for n in contents if n.endswith(".dist-info/RECORD")]
        if tag:
            lines = contents[wheel_info].decode().splitlines()
            tagged = {
                line.split(":", 1)[1].strip().rsplit("-", 1)[0]
                for line in lines
                if line.startswith("Tag:")
            }
            kept = [line for line in lines if not line.startswith("Tag:")]
            retagged = [f"Tag: {python_abi}-{tag}" for python_abi in sorted(tagged)]
            contents[wheel_info] = "\n".join([*kept, *retagged, ""]).encode()
        contents.update(files)
        body = [n for n in contents if n != record]
        lines = [record_line(n, contents[n]) for n in body] + [f"{record},,"]
        contents[record] = ("\n".join(lines) + "\n").encode()
        for n, data in contents.items():
            dst.writestr(n, data)
    return out


def zig_stub(source: str, out: Path, glibc: str, arch: str, *extra: str) -> bytes:
    """A shared object compiled by zig against the glibc version given; EXTRA:
    more linker inputs and flags."""
    c_file = out.with_suffix(".c")
    c_file.write_text(source)
    command = [sys.executable, "-m", "ziglang", "cc", "-shared", "-fPIC"]
    command += ["-target", f"{arch}-linux-gnu.{glibc}", str(c_file), *extra]
    subprocess.run([*command, "-o", str(out)], check=True)
    return out.read_bytes()


NEW_GLIBC = """#define _GNU_SOURCE
#include <dlfcn.h>
/* _dl_find_object appeared in glibc 2.35. */
int f(void *pc) { struct dl_find_object r; return _dl_find_object(pc, &r); }
"""
LOADER = "void *vkGetInstanceProcAddr(void *i, const char *n) { (void)i; (void)n; return 0; }\n"
LINKS_LOADER = """void *vkGetInstanceProcAddr(void *, const char *);
void *f(void) { return vkGetInstanceProcAddr(0, "vkCreateInstance"); }
"""


def self_test(wheel: Path, policy: str) -> bool:
    if not check(wheel, policy):
        return False
    arch = architecture(wheel)
    extension = "flashport/_core.abi3.so"
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        loader = tmp_dir / "libvulkan.so.1"
        zig_stub(LOADER, loader, "2.17", arch, f"-Wl,-soname,{loader.name}")
        cases = {
            "tag": rewrite(wheel, _dir(tmp_dir, "tag"), tag=f"manylinux_2_35_{arch}"),
            "auditwheel": rewrite(
                wheel,
                _dir(tmp_dir, "glibc"),
                files={extension: zig_stub(NEW_GLIBC, tmp_dir / "new.so", "2.35", arch)},
            ),
            "vulkan": rewrite(
                wheel,
                _dir(tmp_dir, "vulkan"),
                files={
                    extension: zig_stub(LINKS_LOADER, tmp_dir / "vk.so", "2.17", arch, str(loader))
                },
            ),
            "bundled": rewrite(
                wheel,
                _dir(tmp_dir, "bundled"),
                files={"flashport.libs/libvulkan-0a1b2c3d.so.1": loader.read_bytes()},
            ),
        }
        for kind, bad in cases.items():
            kinds = {k for k, _ in problems(bad, policy)}
            caught = kind in kinds
            ok &= caught
            verdict = "rejected" if caught else "NOT rejected"
            print(f"check_wheel self-test: {kind:10} fault {verdict} (found: {sorted(kinds)})")
    return ok


def _dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--policy", required=True, help="manylinux2014, manylinux_2_28, ...")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    ok = (self_test if args.self_test else check)(args.wheel, args.policy)
    if not ok:
        sys.exit(f"check_wheel: FAILED for {args.wheel.name}")


if __name__ == "__main__":
    main()
