from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tandem.adapters import AdapterStore, Manifest, file_checksum, read_adapter_config
from tandem.errors import AdapterRejected, VersionExists


def publish(store: AdapterStore, run: str = "r", version: int = 1, payload: bytes = b"weights") -> Manifest:
    with store.staging(run, version) as tmp:
        (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (tmp / "adapter" / "adapter_model.safetensors").write_bytes(payload)
        (tmp / "trainer").mkdir()
        (tmp / "trainer" / "optimizer.pt").write_bytes(b"opt")
        return store.publish(tmp, Manifest(run=run, version=version, parent=version - 1, step=version,
                                           job_id="j", base_model="m", lora_rank=8))


def test_publish_then_verify(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    m = publish(store)
    assert set(m.files) == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "trainer/optimizer.pt"}
    assert store.verify("r", 1) == store.read_manifest("r", 1)
    assert store.versions("r") == [1]
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "r").iterdir())


def test_new_versions_are_hashed_with_xxh3_and_old_sha256_manifests_still_verify(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    m = publish(store)
    assert m.checksum == "xxh3_128" and m.files["adapter/adapter_model.safetensors"] == file_checksum(
        tmp_path / "r" / "v000001" / "adapter" / "adapter_model.safetensors", "xxh3_128")
    old = publish(store, version=2, payload=b"older weights")
    vdir = tmp_path / "r" / "v000002"
    raw = json.loads((vdir / "manifest.json").read_text())
    del raw["checksum"]  # as written before manifests named their checksum
    raw["files"] = {rel: hashlib.sha256((vdir / rel).read_bytes()).hexdigest() for rel in raw["files"]}
    (vdir / "manifest.json").write_text(json.dumps(raw))
    assert store.verify("r", 2).checksum == "sha256" and store.verify("r", 2).files != old.files
    (vdir / "adapter" / "adapter_model.safetensors").write_bytes(b"older weightz")
    with pytest.raises(AdapterRejected, match="checksum of adapter/adapter_model.safetensors"):
        store.verify("r", 2)


def test_checksums_from_the_writer_are_taken_as_given_and_the_rest_are_computed(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    with store.staging("r", 1) as tmp:
        (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (tmp / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
        m = store.publish(tmp, Manifest(run="r", version=1, parent=0, step=1, job_id="j", base_model="m",
                                        lora_rank=8),
                          checksums={"adapter/adapter_model.safetensors": "from-the-writer"}, durable=False)
    assert m.files["adapter/adapter_model.safetensors"] == "from-the-writer"
    assert m.files["adapter/adapter_config.json"] == file_checksum(tmp_path / "r/v000001/adapter/adapter_config.json")
    store.sync("r", 1)  # fsync after the fact: the files, the directories, the run's entry
    with pytest.raises(AdapterRejected, match="checksum"):  # a writer that lied is caught on verify
        store.verify("r", 1)


def test_versions_are_immutable(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    with pytest.raises(VersionExists):
        publish(store, payload=b"other")
    assert (store.adapter_dir("r", 1) / "adapter_model.safetensors").read_bytes() == b"weights"


def test_a_failed_write_leaves_no_version(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.staging("r", 1) as tmp:
            (tmp / "adapter" / "partial").write_bytes(b"x")
            raise RuntimeError("crash while writing")
    assert store.versions("r") == []
    assert list((tmp_path / "r").iterdir()) == []


def test_stale_staging_dirs_are_invisible_and_removable(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    (tmp_path / "r" / ".tmp-v000001-dead").mkdir(parents=True)
    assert store.versions("r") == []
    assert store.remove_stale_staging("r") == 1


def test_bad_checksum_is_rejected(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    (store.adapter_dir("r", 1) / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(AdapterRejected, match="checksum of adapter/adapter_model.safetensors"):
        store.verify("r", 1)


def test_missing_file_is_rejected(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    (store.adapter_dir("r", 1) / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterRejected, match="missing"):
        store.verify("r", 1)


@pytest.mark.parametrize("path", ["../outside", "/etc", "r/../../x"])
def test_paths_outside_the_store_are_refused(tmp_path: Path, path: str) -> None:
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(AdapterRejected, match="outside the adapter store"):
        store.resolve(path)


def test_run_names_that_escape_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterRejected, match="run name"):
        AdapterStore(tmp_path).version_dir("../x", 1)


def test_verify_only_checks_one_subdirectory(tmp_path: Path) -> None:
    """The inference side checks adapter/ and leaves the trainer's optimizer state alone."""
    store = AdapterStore(tmp_path)
    publish(store)
    (store.version_dir("r", 1) / "trainer" / "optimizer.pt").write_bytes(b"changed by a resumed trainer")
    assert store.verify("r", 1, only="adapter").version == 1
    with pytest.raises(AdapterRejected, match="checksum of trainer/optimizer.pt"):
        store.verify("r", 1)
    (store.adapter_dir("r", 1) / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(AdapterRejected, match="checksum of adapter/adapter_model.safetensors"):
        store.verify("r", 1, only="adapter")


def test_trainer_state_is_attached_whole_or_not_at_all(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    with store.staging("r", 1) as tmp:
        (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
        store.publish(tmp, Manifest(run="r", version=1, parent=0, step=1, job_id="j", base_model="m", lora_rank=8))
    with pytest.raises(RuntimeError):
        with store.trainer_state("r", 1) as state:
            (state / "optimizer.pt").write_bytes(b"half")
            raise RuntimeError("crash while writing the optimizer state")
    assert not (store.version_dir("r", 1) / "trainer").exists()
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "r").iterdir())
    with store.trainer_state("r", 1) as state:
        (state / "optimizer.pt").write_bytes(b"whole")
    assert (store.version_dir("r", 1) / "trainer" / "optimizer.pt").read_bytes() == b"whole"
    assert store.verify("r", 1).files.keys() == {"adapter/adapter_config.json"}
    with pytest.raises(VersionExists):
        with store.trainer_state("r", 1):
            pass


def part_of_version(store: AdapterStore, what: str) -> Path:
    """One part of run r's v1: its run, version or adapter directory, its weights or its manifest."""
    return {
        "run_dir": store.run_dir("r"),
        "version_dir": store.version_dir("r", 1),
        "adapter_dir": store.adapter_dir("r", 1),
        "weights_file": store.adapter_dir("r", 1) / "adapter_model.safetensors",
        "manifest": store.version_dir("r", 1) / "manifest.json",
    }[what]


def move_out(target: Path, outside: Path) -> None:
    """Replace `target` by a symlink to where it now lies, `outside`."""
    target.rename(outside)
    target.symlink_to(outside)


@pytest.mark.parametrize("what", ["run_dir", "version_dir", "adapter_dir", "weights_file", "manifest"])
def test_a_symlink_anywhere_in_a_version_is_refused_before_checksums(tmp_path: Path, what: str) -> None:
    store = AdapterStore(tmp_path / "store")
    publish(store)
    target = part_of_version(store, what)
    move_out(target, tmp_path / "outside")
    with pytest.raises(AdapterRejected, match="outside the adapter store"):
        store.check("r", 1, only="adapter")
    with pytest.raises(AdapterRejected, match="outside the adapter store"):
        store.verify("r", 1)


@pytest.mark.parametrize("what", ["run_dir", "version_dir", "adapter_dir", "weights_file", "manifest"])
def test_a_version_with_a_symlink_anywhere_is_not_plain(tmp_path: Path, what: str) -> None:
    """`plain` (whether `check` would touch only the store) finds each link without following it."""
    store = AdapterStore(tmp_path / "store")
    publish(store)
    assert store.plain("r", 1) and store.plain("r", 1, path="r/v000001/adapter")
    target = part_of_version(store, what)
    move_out(target, tmp_path / "outside")
    assert not store.plain("r", 1)


@pytest.mark.parametrize(("path", "plain"), [
    ("r/v000001/adapter", True), ("./r/v000001/adapter/", True),
    ("r/v000001/../v000001/adapter", False),  # `..` is resolved through links by check: not on the loop
    ("r/v000001", False), ("../elsewhere/r/v000001/adapter", False), ("/elsewhere/adapter", False),
])
def test_an_event_path_is_plain_only_where_it_names_the_adapter_directory_as_written(
    tmp_path: Path, path: str, plain: bool
) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    assert store.plain("r", 1, path=path) is plain


def test_a_missing_version_a_bad_run_name_or_a_directory_in_adapter_is_not_plain(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    assert not store.plain("r", 2) and not store.plain("../r", 1) and not store.plain("nope", 1)
    (store.adapter_dir("r", 1) / "sub").mkdir()  # check walks into it: a link there is not looked for here
    assert not store.plain("r", 1)


def test_a_symlink_to_elsewhere_in_the_store_is_refused_too(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store, version=1, payload=b"one")
    publish(store, version=2, payload=b"two")
    weights = store.adapter_dir("r", 2) / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(store.adapter_dir("r", 1) / "adapter_model.safetensors")
    with pytest.raises(AdapterRejected, match="is a symlink"):
        store.check("r", 2)


def test_check_confines_the_event_path_and_every_file_but_reads_no_checksum(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    assert store.check("r", 1, path="r/v000001/adapter", only="adapter").version == 1
    assert store.check("r", 1, path=store.adapter_dir("r", 1)).version == 1
    with pytest.raises(AdapterRejected, match="not the version's adapter directory"):
        store.check("r", 1, path="r/v000001")
    with pytest.raises(AdapterRejected, match="outside the adapter store"):
        store.check("r", 1, path="../elsewhere")
    (store.adapter_dir("r", 1) / "adapter_model.safetensors").write_bytes(b"tampered")
    assert store.check("r", 1).version == 1  # checksums are verify's job


def test_files_the_manifest_does_not_list_are_refused(tmp_path: Path) -> None:
    """The engine opens the whole adapter directory, so nothing unlisted may sit in it."""
    store = AdapterStore(tmp_path)
    publish(store)
    (store.adapter_dir("r", 1) / "adapter_model.bin").write_bytes(b"unlisted")
    with pytest.raises(AdapterRejected, match="adapter/adapter_model.bin is not in the manifest"):
        store.check("r", 1, only="adapter")


@pytest.mark.parametrize("rel", ["adapter/../../../../etc/passwd", "/etc/passwd", "adapter/../manifest.json"])
def test_manifest_paths_that_leave_the_version_are_refused(tmp_path: Path, rel: str) -> None:
    store = AdapterStore(tmp_path)
    publish(store)
    path = store.version_dir("r", 1) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][rel] = "0" * 64
    path.write_text(json.dumps(manifest))
    with pytest.raises(AdapterRejected, match="leaves"):
        store.check("r", 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "no adapter_config.json in"),
        ("{not json", "adapter_config.json is unreadable"),
        ("[1]", "adapter_config.json is not a JSON object"),
        ('{"r": 8, "rank_pattern": [4]}', "adapter_config.json: rank_pattern is not a mapping"),
        ('{"r": "8"}', "adapter_config.json has no valid LoRA rank 'r'"),
        ('{"r": 8, "rank_pattern": {"q_proj": 0}}', "adapter_config.json has no valid LoRA rank 'r'"),
    ],
)
def test_read_adapter_config_names_the_file_and_what_is_wrong(tmp_path: Path, text: str | None, expected: str) -> None:
    if text is not None:
        (tmp_path / "adapter_config.json").write_text(text)
    with pytest.raises(AdapterRejected, match=expected) as caught:
        read_adapter_config(tmp_path)
    assert str(tmp_path) in str(caught.value)


def test_read_adapter_config_returns_the_config_and_the_store_reads_through_it(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 4}, "x": 1}))
    assert read_adapter_config(tmp_path) == {"r": 8, "rank_pattern": {"q_proj": 4}, "x": 1}
    store = AdapterStore(tmp_path / "store")
    publish(store)
    (store.adapter_dir("r", 1) / "adapter_config.json").write_text("[]")
    with pytest.raises(AdapterRejected, match="not a JSON object"):
        store.adapter_config("r", 1)
