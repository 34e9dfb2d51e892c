"""The software bill of materials of a published image (CycloneDX 1.6 JSON), for images/publish.sh.

Runs with .venv-tools/bin/python (`make tools`: cyclonedx-bom and cyclonedx-python-lib from the
hash-checked images/locks/tools.txt)::

    sbom.py python IMAGE VERSION < cyclonedx-py.json > IMAGE.cdx.json   # the image as the BOM's subject
    sbom.py deb IMAGE VERSION < packages.tsv > IMAGE.cdx.json           # from `dpkg-query -W` (name, version, arch)

`python`: cyclonedx-py's BOM of the image's lock files, with the image (a container named IMAGE,
at the version of its org.opencontainers.image.version label) set as what the BOM describes.
`deb`: an image without Python environments (redis, the router): every Debian package in it,
as pkg:deb package URLs. Either way the result is validated against the CycloneDX 1.6 schema.
"""

from __future__ import annotations

import json
import sys

from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output.json import JsonV1Dot6
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL


def subject(image: str, version: str) -> dict[str, str]:
    return {"type": "container", "bom-ref": image, "name": image, "version": version}


def from_python(image: str, version: str, text: str) -> str:
    doc = json.loads(text)
    doc.setdefault("metadata", {})["component"] = subject(image, version)
    refs = [c["bom-ref"] for c in doc.get("components", []) if "bom-ref" in c]
    doc.setdefault("dependencies", []).append({"ref": image, "dependsOn": refs})
    return json.dumps(doc, indent=2, sort_keys=True)


def from_deb(image: str, version: str, text: str) -> str:
    bom = Bom()
    main = Component(type=ComponentType.CONTAINER, bom_ref=image, name=image, version=version)
    bom.metadata.component = main
    packages = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, pkg_version, arch = line.split("\t")
        purl = PackageURL("deb", "debian", name, pkg_version, qualifiers={"arch": arch})
        packages.append(Component(type=ComponentType.LIBRARY, bom_ref=str(purl), name=name, version=pkg_version,
                                  purl=purl))
    if not packages:
        sys.exit(f"sbom.py deb {image}: no packages on stdin (expected dpkg-query -W lines: name, version, arch)")
    bom.components.update(packages)
    bom.register_dependency(main, packages)
    return JsonV1Dot6(bom).output_as_string(indent=2)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("python", "deb"):
        sys.exit("usage: sbom.py python|deb IMAGE VERSION < input > IMAGE.cdx.json")
    kind, image, version = argv
    out = (from_python if kind == "python" else from_deb)(image, version, sys.stdin.read())
    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(out)
    if error is not None:
        sys.exit(f"sbom.py {kind} {image}: the BOM is not valid CycloneDX 1.6: {error}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
