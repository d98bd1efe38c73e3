"""VTAB-1k / FGVC loading from local folders (fixtures made here) and the offline hub error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from petl import data
from petl.data import images, vtab
from petl.data.transforms import ImageSpec, pil_to_tensor


def write_images(folder: Path, count: int, size: int = 6, mode: str = "RGB") -> list[str]:
    """Tiny PNGs with distinct content; returns their paths relative to ``folder``."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        pixels = np.full((size, size, 3), i * 7 % 256, dtype=np.uint8)
        Image.fromarray(pixels).convert(mode).save(folder / "images" / f"img {i}.png")
        names.append(f"images/img {i}.png")
    return names


def write_list(path: Path, entries: list[tuple[str, int]]) -> None:
    path.write_text("".join(f"{name} {label}\n" for name, label in entries))


def make_vtab_task(folder: Path, sizes: dict[str, int], num_classes: int, images: int = 12) -> None:
    """A VTAB-1k task folder; list entries may reuse the few images (lists, not files, are sized), except at the
    protocol's sizes, which the strict checks see: there every entry has its own image (``images`` is ignored)."""
    if sizes["train800"] == 800:  # strict: no image listed twice, none shared by train800, val200 and test
        names = write_images(folder, sizes["train800"] + sizes["val200"] + sizes["test"], size=2)
        train = [(names[i], i % num_classes) for i in range(800)]
        val = [(names[800 + i], (i + 1) % num_classes) for i in range(sizes["val200"])]
        test = [(names[1000 + i], i % num_classes) for i in range(sizes["test"])]
        write_list(folder / "train800.txt", train)
        write_list(folder / "val200.txt", val)
        write_list(folder / "train800val200.txt", train + val)
        write_list(folder / "test.txt", test)
        return
    names = write_images(folder, images)
    train = [(names[i % images], i % num_classes) for i in range(sizes["train800"])]
    val = [(names[(i + 3) % images], (i + 1) % num_classes) for i in range(sizes["val200"])]
    test = [(names[(i + 5) % images], i % num_classes) for i in range(sizes["test"])]
    write_list(folder / "train800.txt", train)
    write_list(folder / "val200.txt", val)
    write_list(folder / "train800val200.txt", train + val)
    write_list(folder / "test.txt", test)


SMALL = {"train800": 8, "val200": 2, "test": 5}
FULL = {"train800": 800, "val200": 200, "test": 30}


def test_local_vtab_fixture_loads(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    sizes = {}
    for split in data.SPLITS:
        ds = data.build_dataset("vtab/dtd", split, image_size=32, root=str(tmp_path), strict=False)
        sizes[split] = len(ds)
        image, label = ds[0]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert isinstance(label, int) and 0 <= label < 47
    assert sizes == {"train800": 8, "val200": 2, "train800val200": 10, "test": 5}
    # Normalisation off gives [0, 1] pixels; the first fixture image is black.
    ds = data.build_dataset("vtab/dtd", "train800", image_size=16, normalize=False, root=str(tmp_path), strict=False)
    image, label = ds[0]
    assert image.shape == (3, 16, 16) and float(image.max()) == 0.0 and label == 0
    image, _ = ds[1]
    torch.testing.assert_close(image, torch.full((3, 16, 16), 7 / 255))


def test_full_size_fixture_passes_strict_checks(tmp_path):
    # The field's folder name (oxford_iiit_pet) is found as well as petl's (pets).
    make_vtab_task(tmp_path / "oxford_iiit_pet", FULL, num_classes=37)
    ds = data.build_dataset("vtab/pets", "train800val200", image_size=8, root=str(tmp_path))
    assert len(ds) == 1000
    assert len(data.build_dataset("vtab/pets", "test", image_size=8, root=str(tmp_path))) == 30


def test_wrong_split_size_fails_clearly(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    with pytest.raises(ValueError, match=r"vtab/dtd: .*train800\.txt lists 8 images, VTAB-1k expects 800"):
        data.build_dataset("vtab/dtd", "test", image_size=32, root=str(tmp_path))


def test_class_count_mismatch_fails(tmp_path):
    # Labels of a 47-class task in a folder registered as the 2-class patch_camelyon.
    make_vtab_task(tmp_path / "patch_camelyon", SMALL, num_classes=5)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        data.build_dataset("vtab/patch_camelyon", "train800", image_size=32, root=str(tmp_path), strict=False)
    # Right sizes, labels in range, but only 2 of the 4 classes present: strict mode notices.
    make_vtab_task(tmp_path / "kitti", FULL, num_classes=2)
    with pytest.raises(ValueError, match="2 distinct labels but the task has 4 classes"):
        data.build_dataset("vtab/kitti_dist", "train800", image_size=32, root=str(tmp_path))


def test_missing_folder_and_images_are_clear(tmp_path):
    with pytest.raises(ValueError, match="vtab/svhn: no task folder found"):
        data.build_dataset("vtab/svhn", "train800", image_size=32, root=str(tmp_path))
    make_vtab_task(tmp_path / "svhn", SMALL, num_classes=10)
    (tmp_path / "svhn" / "images" / "img 0.png").unlink()
    with pytest.raises(ValueError, match="1 listed image file.s. missing, e.g. .*: restore them"):
        data.build_dataset("vtab/svhn", "train800", image_size=32, root=str(tmp_path), strict=False)


def test_a_missing_image_of_a_local_folder_exits_2_as_an_unreadable_one_does(tmp_path, capsys):
    # A listed image not there exited 1 (data out of reach) and one that would not decode 2: both are bad input in the
    # folder the user gave.  In petl's own unpacked hub copy a missing image is data out of reach still.
    from conftest import tiny_run

    from petl.cli import run as cli

    make_vtab_task(tmp_path / "svhn", FULL, num_classes=10)
    image = tmp_path / "svhn" / "images" / "img 3.png"
    model = [option for option in tiny_run(depth=1) if not option.startswith("data")]
    argv = ["method=lora", "data=vtab/svhn", f"data.root={tmp_path}", *model, f"output_dir={tmp_path / 'run'}"]

    def refusal() -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1, err
        return err

    image.unlink()
    assert "1 listed image file(s) missing, e.g." in refusal()
    image.write_bytes(b"junk")
    assert "1 listed image(s) cannot be used" in refusal()


def test_every_bad_image_is_reported_by_path_when_the_dataset_is_built(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    images = tmp_path / "dtd" / "images"
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(images / "img 1.png")
    good = (images / "img 1.png").read_bytes()
    (images / "img 0.png").write_bytes(b"")  # zero bytes
    (images / "img 1.png").write_bytes(good[: len(good) // 2])  # truncated in the pixel data
    (images / "img 2.png").write_bytes(b"not an image at all")
    # img 3 appears in val200 only; train800 names images 0-7, test 5-11.
    with pytest.raises(data.BadImagesError) as caught:
        data.build_dataset("vtab/dtd", "train800", image_size=32, root=str(tmp_path), strict=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("vtab/dtd: 3 listed image(s) cannot be used")
    assert [path.name for path, _ in caught.value.bad] == ["img 0.png", "img 1.png", "img 2.png"]
    reasons = {"img 0.png": "empty file", "img 1.png": "cannot decode", "img 2.png": "not a readable image"}
    for name, reason in reasons.items():
        assert f"{images / name} ({reason}" in message
    assert isinstance(caught.value, ValueError)
    # A split that lists none of them builds.
    assert len(data.build_dataset("vtab/dtd", "test", image_size=32, root=str(tmp_path), strict=False)) == 5


def test_truncated_jpeg_is_found_up_front(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    path = tmp_path / "dtd" / "images" / "img 4.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path, format="JPEG")
    path.write_bytes(path.read_bytes()[:-600])
    with pytest.raises(data.BadImagesError, match=r"1 listed image\(s\).*img 4\.png \(cannot decode"):
        data.build_dataset("vtab/dtd", "train800", image_size=32, root=str(tmp_path), strict=False)


def test_sixteen_bit_grey_png_is_scaled_not_white(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    ramp = np.linspace(0, 65535, 16 * 16).round().astype(np.uint16).reshape(16, 16)
    Image.fromarray(ramp).save(tmp_path / "dtd" / "images" / "img 0.png")
    assert Image.open(tmp_path / "dtd" / "images" / "img 0.png").mode.startswith("I")
    ds = data.build_dataset("vtab/dtd", "train800", image_size=16, normalize=False, root=str(tmp_path), strict=False)
    image, _ = ds[0]
    expected = torch.from_numpy((ramp.astype(np.float64) / 257).round() / 255).float()
    for channel in image:
        torch.testing.assert_close(channel, expected, atol=1 / 255 + 1e-6, rtol=0)
    assert image.min() == 0 and image.max() == 1 and 0.45 < image.mean() < 0.55
    # Float images have no known range: refused by path.
    Image.fromarray(ramp.astype(np.float32)).save(tmp_path / "dtd" / "images" / "img 1.tiff")
    (tmp_path / "dtd" / "train800.txt").write_text("images/img 1.tiff 0\n")
    with pytest.raises(data.BadImagesError, match=r"img 1\.tiff \(floating-point pixels"):
        data.build_dataset("vtab/dtd", "train800", image_size=16, root=str(tmp_path), strict=False)


def test_images_are_held_decoded_and_fingerprinted(tmp_path, monkeypatch):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    build = lambda: data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(tmp_path), strict=False)  # noqa: E731
    ds = build()
    assert ds.images is not None and len(ds.images) == 8 and ds.images[0].dtype == np.uint8
    first = [ds[i][0] for i in range(len(ds))]
    # Decoding per access (above the memory limit) gives the same tensors.
    monkeypatch.setattr(images, "DECODED_MEMORY_LIMIT", 10)
    lazy = build()
    assert lazy.images is None and lazy.fingerprint == ds.fingerprint
    for index, tensor in enumerate(first):
        assert torch.equal(lazy[index][0], tensor)
    monkeypatch.undo()
    # The fingerprint is stable, follows the content, the labels and the listed paths.
    assert len(ds.fingerprint) == 64 and build().fingerprint == ds.fingerprint
    moved = tmp_path / "moved"
    (tmp_path / "dtd").rename(moved / "dtd" if moved.mkdir() is None else moved)
    assert data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(moved), strict=False).fingerprint == (
        ds.fingerprint
    )
    image = moved / "dtd" / "images" / "img 3.png"
    Image.fromarray(np.full((6, 6, 3), 99, np.uint8)).save(image)
    changed = data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(moved), strict=False)
    assert changed.fingerprint != ds.fingerprint
    lists = moved / "dtd" / "train800.txt"
    lists.write_text(lists.read_text().replace("images/img 0.png 0", "images/img 0.png 1"))
    relabelled = data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(moved), strict=False)
    assert relabelled.fingerprint not in (ds.fingerprint, changed.fingerprint)
    # Decoding per access names the file that went bad after the build.
    monkeypatch.setattr(images, "DECODED_MEMORY_LIMIT", 10)
    lazy = data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(moved), strict=False)
    (moved / "dtd" / "images" / "img 0.png").write_bytes(b"")
    with pytest.raises(data.BadImagesError, match=r"1 listed image\(s\).*img 0\.png \(empty file\)"):
        lazy[0]


@pytest.mark.parametrize("crop", [False, True])
def test_large_images_are_held_at_the_size_the_transform_resizes_them_to_with_the_same_tensors(tmp_path, crop):
    # Every image was held at its stored size: a folder of phone photos filled the 4 GiB limit at a few hundred
    # images and was decoded again on every access after it.  Held resized as pil_to_tensor first resizes them.
    rng = np.random.default_rng(0)
    stored = {
        "wide.png": rng.integers(0, 256, (90, 160, 3), np.uint8),
        "grey.png": rng.integers(0, 256, (120, 70), np.uint8),
        "tiny.png": rng.integers(0, 256, (5, 7, 3), np.uint8),  # smaller than the output: held as it is
    }
    for name, array in stored.items():
        Image.fromarray(array).save(tmp_path / name)
    items = [(tmp_path / name, 0) for name in stored]
    for augment in (False, True) if crop else (False,):
        spec = ImageSpec(image_size=16, crop=crop, augment=augment, interpolation="bicubic")
        ds = images.FileListDataset(items, spec, folder=tmp_path)
        assert ds.images[0].nbytes < stored["wide.png"].nbytes / 10 and ds.images[2].shape == (5, 7, 3)
        for index, array in enumerate(stored.values()):
            torch.manual_seed(index)  # the random crop and flip draw the same numbers either way
            held = ds[index][0]
            torch.manual_seed(index)
            assert torch.equal(held, pil_to_tensor(Image.fromarray(array), spec)), (augment, index)
    ds.spec = ImageSpec(image_size=24, crop=crop)  # another geometry: decoded again, not the held pixels resized
    assert torch.equal(ds[0][0], pil_to_tensor(Image.fromarray(stored["wide.png"]), ds.spec))


def test_bad_list_line_names_file_and_line(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    (tmp_path / "dtd" / "val200.txt").write_text("images/img 1.png 3\nimages/img 2.png x\n")
    with pytest.raises(ValueError, match=r"val200\.txt:2: label 'x'"):
        data.build_dataset("vtab/dtd", "val200", image_size=32, root=str(tmp_path), strict=False)


def test_fgvc_text_lists(tmp_path):
    folder = tmp_path / "cub"
    names = write_images(folder, 6, mode="L")
    write_list(folder / "train.txt", [(names[i], i) for i in range(4)])
    write_list(folder / "val.txt", [(names[4], 1)])
    write_list(folder / "test.txt", [(names[5], 199)])
    lengths = {
        s: len(data.build_dataset("fgvc/cub", s, image_size=32, root=str(tmp_path), strict=False)) for s in data.SPLITS
    }
    assert lengths == {"train800": 4, "val200": 1, "train800val200": 5, "test": 1}
    image, label = data.build_dataset("fgvc/cub", "test", image_size=32, root=str(tmp_path), strict=False)[0]
    assert image.shape == (3, 32, 32) and label == 199
    # Strict mode wants every one of the 200 classes somewhere.
    with pytest.raises(ValueError, match="distinct labels but the task has 200 classes"):
        data.build_dataset("fgvc/cub", "test", image_size=32, root=str(tmp_path))


def test_fgvc_vpt_json_layout(tmp_path):
    # VPT-style: json maps paths (relative to images/) to 1-based class ids.
    folder = tmp_path / "StanfordCars"
    write_images(folder, 4)
    files = {"train": {"img 0.png": 1, "img 1.png": 196}, "val": {"img 2.png": 2}, "test": {"img 3.png": 196}}
    for split, mapping in files.items():
        (folder / f"{split}.json").write_text(json.dumps(mapping))
    train = data.build_dataset("fgvc/cars", "train800", image_size=32, root=str(tmp_path), strict=False)
    assert [label for _, label in train.items] == [0, 2]
    assert len(data.build_dataset("fgvc/cars", "train800val200", image_size=32, root=str(tmp_path), strict=False)) == 3
    image, label = data.build_dataset("fgvc/cars", "test", image_size=32, root=str(tmp_path), strict=False)[0]
    assert image.shape == (3, 32, 32) and label == 2


def test_hub_failure_is_one_clear_error(monkeypatch, tmp_path):
    """Whatever the hub client raises becomes one DatasetUnavailableError without a chained traceback."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise ConnectionError("Max retries exceeded with url: https://huggingface.co/...")

    monkeypatch.setenv(vtab.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(data.DatasetUnavailableError) as caught:
        data.build_dataset("vtab/sun397", "train800", image_size=32)
    message = str(caught.value)
    assert "vtab/sun397" in message and vtab.VTAB_HUB_ID in message and "data.root=/path" in message
    assert "ConnectionError" in message
    assert caught.value.__suppress_context__ and caught.value.__cause__ is None
    # sun397's zip folder bears its short name: said once, it was "<root>/sun397/ or <root>/sun397/".
    assert "where <root>/sun397/ holds the images" in message


def test_dataset_without_hub_copy_points_to_local_folder():
    with pytest.raises(data.DatasetUnavailableError, match="fgvc/nabirds is unavailable: no public Hugging Face"):
        data.build_dataset("fgvc/nabirds", "train800", image_size=32)


def test_vtab_from_cached_extraction(monkeypatch, tmp_path):
    """A task already unpacked in petl's cache loads without touching the hub."""
    monkeypatch.setenv(vtab.CACHE_ENV, str(tmp_path))
    make_vtab_task(tmp_path / "vtab-1k" / "eurosat", FULL, num_classes=10)
    assert len(data.build_dataset("vtab/eurosat", "val200", image_size=8)) == 200
    (tmp_path / "vtab-1k" / "eurosat" / "images" / "img 0.png").unlink()  # no file the user gave: unavailable data
    with pytest.raises(data.DatasetUnavailableError, match="1 listed image file.s. missing"):
        data.build_dataset("vtab/eurosat", "train800", image_size=8)


@pytest.mark.slow
def test_offline_hub_error_in_a_fresh_process(tmp_path):
    """With the documented offline switches and an empty cache, both hub paths fail clearly."""
    script = textwrap.dedent(
        """
        from petl import data
        for name in ("vtab/dtd", "fgvc/cars"):
            try:
                data.build_dataset(name, "train800", image_size=32)
            except data.DatasetUnavailableError as error:
                print("ERROR:", error)
        """
    )
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        PETL_CACHE_DIR=str(tmp_path / "petl"),
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(lines) == 2, result.stdout + result.stderr
    assert "vtab/dtd" in lines[0] and "XiN0919/VTAB-1k" in lines[0] and "data.root=/path" in lines[0]
    assert "fgvc/cars" in lines[1] and "tanganke/stanford_cars" in lines[1] and "data.root=/path" in lines[1]
    assert "Traceback" not in result.stderr


def vtab_archive(source: Path, archive: Path) -> Path:
    """The hub's VTAB-1k zip, faked: every task folder under ``source``, inside ``vtab-1k/``."""
    import zipfile

    with zipfile.ZipFile(archive, "w") as bundle:
        for path in sorted(source.rglob("*")):
            if path.is_file():
                bundle.write(path, "vtab-1k/" + path.relative_to(source).as_posix())
    return archive


def test_vtab_hub_archive_is_unpacked_per_task(monkeypatch, tmp_path):
    """The hub path downloads the field's zip (faked here) and unpacks only the requested task."""

    import huggingface_hub

    source = tmp_path / "source"
    make_vtab_task(source / "oxford_flowers102", FULL, num_classes=102, images=3)
    make_vtab_task(source / "dtd", SMALL, num_classes=47, images=2)
    archive = vtab_archive(source, tmp_path / "vtab-1k.zip")
    calls = []

    def fake_download(repo_id, filename, repo_type):
        calls.append((repo_id, filename, repo_type))
        return str(archive)

    monkeypatch.setenv(vtab.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    ds = data.build_dataset("vtab/flowers102", "train800", image_size=8)
    assert len(ds) == 800 and ds[0][0].shape == (3, 8, 8)
    assert calls == [(vtab.VTAB_HUB_ID, vtab.VTAB_HUB_FILE, "dataset")]
    unpacked = tmp_path / "cache" / "vtab-1k"
    assert sorted(p.name for p in unpacked.iterdir()) == ["oxford_flowers102"]
    # The second build reads the unpacked folder and does not ask the hub again.
    data.build_dataset("vtab/flowers102", "test", image_size=8)
    assert len(calls) == 1


@pytest.mark.parametrize("damage", ["cut short", "a member's bytes"])
def test_a_damaged_downloaded_archive_is_one_line_naming_it(damage, monkeypatch, tmp_path):
    """zipfile's BadZipFile (a cut-short download) or zlib.error (a damaged member) came out of petl-run as a
    traceback; no half-unpacked folder is left to pass for the task's."""
    import huggingface_hub

    source = tmp_path / "source"
    make_vtab_task(source / "dtd", SMALL, num_classes=47, images=2)
    archive = vtab_archive(source, tmp_path / "vtab-1k.zip")
    content = archive.read_bytes()
    if damage == "cut short":
        archive.write_bytes(content[: len(content) // 2])
    else:  # the first member's compressed bytes (after its 30-byte header and name) overwritten
        archive.write_bytes(content[:40] + b"\xff" * 40 + content[80:])
    monkeypatch.setenv(vtab.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, repo_type: str(archive))
    with pytest.raises(data.DatasetUnavailableError) as caught:
        data.build_dataset("vtab/dtd", "train800", image_size=8, strict=False)
    message = str(caught.value)
    assert message.startswith(f"vtab/dtd: the downloaded {archive} is damaged (") and "\n" not in message
    assert message.endswith("to download it again, or pass root=/path (command line: data.root=/path) to a local copy")
    assert not any((tmp_path / "cache").rglob("train800.txt"))


def test_fgvc_hub_copy_with_holdout_validation(monkeypatch):
    """A hub copy with only train/test (faked in memory) gets a seeded 10% validation hold-out."""
    datasets = pytest.importorskip("datasets")

    def rows(labels):
        images = [Image.fromarray(np.full((4, 4, 3), label % 256, dtype=np.uint8)) for label in labels]
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=196)})
        return datasets.Dataset.from_dict({"image": images, "label": list(labels)}, features=features)

    hub = datasets.DatasetDict(train=rows(range(196)), test=rows([5, 7, 195]))
    requested = []

    def fake_load(hub_id, *args, **kwargs):
        requested.append(hub_id)
        return hub

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    splits = {s: data.build_dataset("fgvc/cars", s, image_size=8) for s in data.SPLITS}
    assert requested == ["tanganke/stanford_cars"] * 4
    assert {s: len(d) for s, d in splits.items()} == {"train800": 176, "val200": 20, "train800val200": 196, "test": 3}
    assert not set(splits["train800"].indices) & set(splits["val200"].indices)
    image, label = splits["test"][2]
    assert image.shape == (3, 8, 8) and image.dtype == torch.float32 and label == 195
    # Same seed, same hold-out.
    assert splits["val200"].indices == data.build_dataset("fgvc/cars", "val200", image_size=8).indices


def test_root_at_another_tasks_folder_is_refused_not_trained_under_this_name(tmp_path, monkeypatch):
    # dsprites_loc and dsprites_ori both have 16 classes: the labels could not tell one task from the other, and
    # data=vtab/dsprites_ori with the root at dsprites_loc/ trained dsprites_loc under dsprites_ori's name.
    make_vtab_task(tmp_path / "dsprites_loc", SMALL, num_classes=16)
    with pytest.raises(
        ValueError, match=r"vtab/dsprites_ori: root=.*dsprites_loc is itself a task folder .* not named"
    ):
        data.build_dataset(
            "vtab/dsprites_ori", "train800", image_size=8, root=str(tmp_path / "dsprites_loc"), strict=False
        )
    # The task's own folder as the root still loads (petl's name or the field's, also given as "."), and so does
    # the folder above it.
    assert (
        len(
            data.build_dataset(
                "vtab/dsprites_loc", "train800", image_size=8, root=str(tmp_path / "dsprites_loc"), strict=False
            )
        )
        == 8
    )
    (tmp_path / "dsprites_loc").rename(tmp_path / "kitti")
    make_vtab_task(tmp_path / "kitti", SMALL, num_classes=4)
    monkeypatch.chdir(tmp_path / "kitti")
    assert len(data.build_dataset("vtab/kitti_dist", "test", image_size=8, root=".", strict=False)) == 5
    assert len(data.build_dataset("vtab/kitti_dist", "test", image_size=8, root=str(tmp_path), strict=False)) == 5
    # FGVC the same way: a CUB folder is no Stanford Cars.
    folder = tmp_path / "CUB_200_2011"
    names = write_images(folder, 2)
    for split in ("train", "val", "test"):
        write_list(folder / f"{split}.txt", [(names[0], 0), (names[1], 1)])
    with pytest.raises(ValueError, match=r"fgvc/cars: root=.*CUB_200_2011 is itself a task folder"):
        data.build_dataset("fgvc/cars", "train800", image_size=8, root=str(folder), strict=False)
    # A root one level too high says which folder to give.
    with pytest.raises(ValueError, match=r"give the folder that holds dtd/ as root \(data\.root\)"):
        data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(tmp_path.parent), strict=False)


def test_an_image_listed_twice_or_in_train_and_test_is_refused(tmp_path):
    # A repeated line passed the 800/200 size check with an image fewer, and a training image listed in test.txt was
    # scored as a test image: both silently wrong cells.
    make_vtab_task(tmp_path / "dtd", FULL, num_classes=47)
    folder = tmp_path / "dtd"
    build = lambda split="train800": data.build_dataset("vtab/dtd", split, image_size=4, root=str(tmp_path))  # noqa: E731
    lists = {name: (folder / f"{name}.txt").read_text() for name in data.SPLITS}
    train, val = lists["train800"].splitlines(True), lists["val200"].splitlines(True)
    (folder / "train800.txt").write_text("".join(train[:-1] + train[:1]))
    (folder / "train800val200.txt").write_text("".join(train[:-1] + train[:1] + val))
    with pytest.raises(ValueError, match=r"train800\.txt lists 1 image\(s\) more than once, e\.g\. .*img 0\.png"):
        build()
    for cut, other, pair in ((train, "test", "train800.txt and test.txt"), (val, "test", "val200.txt and test.txt")):
        for name, text in lists.items():
            (folder / f"{name}.txt").write_text(text)
        (folder / f"{other}.txt").write_text(lists[other] + cut[5])
        with pytest.raises(ValueError, match=rf"1 image\(s\) listed in both {pair}"):
            build("test")
    # A BOM, CRLF line ends and a trailing blank line are only the file's format: the lists load as written.
    for name, text in lists.items():
        (folder / f"{name}.txt").write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode() + b"\r\n\r\n")
    ds = build()
    assert len(ds) == 800 and ds.items[0] == (folder / "images" / "img 0.png", 0)
    # FGVC: a train image in test.txt is refused the same way.
    cub = tmp_path / "CUB_200_2011"
    names = write_images(cub, 202, size=2)
    write_list(cub / "train.txt", [(names[i], i) for i in range(200)])
    write_list(cub / "val.txt", [(names[200], 0)])
    write_list(cub / "test.txt", [(names[201], 1), (names[7], 7)])
    with pytest.raises(ValueError, match=r"fgvc/cub: 1 image\(s\) listed in both train\.txt and test\.txt"):
        data.build_dataset("fgvc/cub", "test", image_size=4, root=str(tmp_path))


def test_a_list_written_on_windows_is_told_to_use_slashes(tmp_path):
    # 'images\\img 0.png' from a list saved on Windows was '8 listed images are missing', the files right there.
    make_vtab_task(tmp_path / "svhn", SMALL, num_classes=10)
    listed = tmp_path / "svhn" / "train800.txt"
    listed.write_text(listed.read_text().replace("images/", "images\\"))
    with pytest.raises(ValueError, match=r"the list writes paths with \\ \(Windows\): write them with /$"):
        data.build_dataset("vtab/svhn", "train800", image_size=8, root=str(tmp_path), strict=False)


def test_fgvc_json_images_are_found_under_images_when_the_first_listed_one_is_missing(tmp_path):
    # The images/ folder was guessed from the first listed image alone: that one missing, every image was looked
    # for beside the lists and all were said to be missing.
    folder = tmp_path / "cub"
    write_images(folder, 3)
    files = {"train": {"gone.png": 1, "img 0.png": 2}, "val": {"img 1.png": 1}, "test": {"img 2.png": 2}}
    for split, mapping in files.items():
        (folder / f"{split}.json").write_text(json.dumps(mapping))
    with pytest.raises(ValueError, match=r"1 listed image file\(s\) missing, e.g. .*images/gone.png"):
        data.build_dataset("fgvc/cub", "train800", image_size=8, root=str(tmp_path), strict=False)
    assert len(data.build_dataset("fgvc/cub", "test", image_size=8, root=str(tmp_path), strict=False)) == 1


def test_fgvc_lists_name_the_one_missing(tmp_path):
    # train.txt and val.txt without test.txt: 'needs train/val/test lists', not which one it lacks.
    folder = tmp_path / "cub"
    names = write_images(folder, 3)
    write_list(folder / "train.txt", [(names[0], 0)])
    write_list(folder / "val.txt", [(names[1], 1)])
    with pytest.raises(ValueError, match="it lacks test.txt$"):
        data.build_dataset("fgvc/cub", "train800", image_size=8, root=str(tmp_path), strict=False)
