"""Every image tandem builds carries the labels `make publish` refuses to push without.

images/publish.sh checks each image for the OCI labels in its LABELS list (set from git by
`make images`); a Dockerfile that does not declare one builds, and then fails to publish, which
also keeps every other image's digests from being published by the images workflow.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]
IMAGES = ROOT / "images"


def published_dockerfiles() -> list[str]:
    """The Dockerfiles of the images `make publish` pushes (the Makefile's STACK_IMAGES_<stack>), with
    each engine's inference image (`tandem-inference-<engine>`, picked by ENGINE=)."""
    makefile = (ROOT / "Makefile").read_text()
    names = {n for line in re.findall(r"^STACK_IMAGES_\w+ :?= (.*)$", makefile, re.M)
             for n in re.findall(r"tandem-[a-z-]*[a-z]", line)}
    assert {"tandem-inference", "tandem-trainer", "tandem-redis"} <= names, names
    engines = [p.name for p in IMAGES.glob("inference-*.Dockerfile") if p.name != "inference-cpu.Dockerfile"]
    return sorted({f"{n.removeprefix('tandem-')}.Dockerfile" for n in names} | set(engines))


def published_labels() -> list[str]:
    script = (IMAGES / "publish.sh").read_text()
    listed = re.search(r"^LABELS=\((.*?)\)", script, re.M | re.S)
    assert listed, "images/publish.sh has no LABELS=(...) list"
    return listed.group(1).split()


@pytest.mark.parametrize("dockerfile", published_dockerfiles())
def test_each_image_declares_the_labels_publishing_checks(dockerfile: str) -> None:
    assert (IMAGES / dockerfile).is_file(), f"a published image has no images/{dockerfile}"
    text = (IMAGES / dockerfile).read_text()
    labels = published_labels()
    assert "org.opencontainers.image.source" in labels
    missing = [label for label in labels if not re.search(rf'^\s*(LABEL\s+)?{re.escape(label)}="\$\{{\w+\}}"', text, re.M)]
    assert missing == [], f"{dockerfile} sets no {missing} from a build argument"
    for arg in re.findall(r'image\.\w+="\$\{(\w+)\}"', text):
        assert re.search(rf"^ARG {arg}\b", text, re.M), f"{dockerfile} uses ${{{arg}}} without `ARG {arg}`"
