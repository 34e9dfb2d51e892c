"""The software bill of materials of a published image (CycloneDX 1.6 JSON), for images/publish.sh.

Runs with .venv-tools/bin/python (`make tools`: cyclonedx-bom and cyclonedx-python-lib from the
hash-checked images/locks/tools.txt)::

    sbom.py IMAGE VERSION --os debian:bookworm --packages packages.tsv [--python cyclonedx-py.json] > IMAGE.cdx.json

The image (a container named IMAGE, at the version of its org.opencontainers.image.version
label) is what the BOM describes. Its components: the Python packages of cyclonedx-py's BOM of
the lock files the image was built from (`--python`; the images without a Python environment,
redis and the router, have none), and every Debian/Ubuntu package installed in it (`--packages`:
`dpkg-query -W` lines of name, version and architecture), as pkg:deb package URLs of that
distribution (`--os ID:CODENAME`, from the image's /etc/os-release). The result is validated
against the CycloneDX 1.6 schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output.json import JsonV1Dot6
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL


def os_packages(text: str, distro: str, codename: str) -> list[Component]:
    packages = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, version, arch = line.split("\t")
        purl = PackageURL("deb", distro, name, version, qualifiers={"arch": arch, "distro": f"{distro}-{codename}"})
        packages.append(Component(type=ComponentType.LIBRARY, bom_ref=str(purl), name=name, version=version, purl=purl))
    return packages


def bom(image: str, version: str, packages: list[Component], python: dict[str, Any] | None) -> str:
    """The OS packages' BOM (cyclonedx-python-lib), with cyclonedx-py's Python components merged in."""
    doc = Bom()
    main = Component(type=ComponentType.CONTAINER, bom_ref=image, name=image, version=version)
    doc.metadata.component = main
    doc.components.update(packages)
    doc.register_dependency(main, packages)
    out: dict[str, Any] = json.loads(JsonV1Dot6(doc).output_as_string())
    components = out.setdefault("components", [])
    if python is not None:
        components.extend(python.get("components", []))
    out["dependencies"] = [{"ref": image, "dependsOn": sorted(c["bom-ref"] for c in components)}]
    return json.dumps(out, indent=2, sort_keys=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sbom.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("image")
    parser.add_argument("version")
    parser.add_argument("--os", required=True, metavar="ID:CODENAME", help="the image's distribution, e.g. debian:bookworm")
    parser.add_argument("--packages", required=True, type=Path, help="dpkg-query -W lines: name, version, arch")
    parser.add_argument("--python", type=Path, help="cyclonedx-py's JSON BOM of the image's lock files")
    args = parser.parse_args(argv)
    distro, sep, codename = args.os.partition(":")
    if not sep or not distro or not codename:
        parser.error(f"--os {args.os!r}: expected ID:CODENAME from the image's /etc/os-release, e.g. debian:bookworm")
    packages = os_packages(args.packages.read_text(), distro, codename)
    if not packages:
        parser.error(f"--packages {args.packages}: no packages (expected dpkg-query -W lines: name, version, arch)")
    python = json.loads(args.python.read_text()) if args.python else None
    out = bom(args.image, args.version, packages, python)
    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(out)
    if error is not None:
        sys.exit(f"sbom.py {args.image}: the BOM is not valid CycloneDX 1.6: {error}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
