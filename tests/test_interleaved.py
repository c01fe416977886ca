"""Interleaved image-text documents: MMC4 and OBELICS layouts read, written, batched and converted."""

import base64
import io
import json
import re
import subprocess
import sys

import pytest

import wds_cloud as wds
from wds_cloud.errors import SampleError
from wds_cloud.interleaved import convert_mmc4, document_items

PIL = pytest.importorskip("PIL.Image")


def png(colour, size=(4, 3)):
    out = io.BytesIO()
    PIL.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


RED, GREEN, BLUE = png((255, 0, 0)), png((0, 255, 0)), png((0, 0, 255))
DOC = ["A cat.", RED, "It sleeps.", GREEN, BLUE, "The end."]


def read(path, **kw):
    return list(wds.DataPipeline(wds.SimpleShardList([path]), wds.tarfile_to_samples(), wds.interleaved(**kw)))


def shape(items):
    return [item.get("text") if "text" in item else item["image"].getpixel((0, 0)) for item in items]


@pytest.mark.parametrize("layout", ["mmc4", "obelics"])
@pytest.mark.parametrize("embed", [False, True])
def test_a_document_written_by_the_helper_reads_back_in_order(tmp_path, layout, embed):
    path = str(tmp_path / "docs.tar")
    with wds.ShardWriter(str(tmp_path / "docs-%d.tar"), maxcount=10) as sink:
        sink.write(wds.interleaved_sample("doc0", DOC, layout=layout, embed=embed, extra={"url": "http://x"}))
        sink.write(wds.interleaved_sample("doc1", ["only text"], layout=layout))
    path = str(tmp_path / "docs-0.tar")
    got = read(path)
    assert [s["__key__"] for s in got] == ["doc0", "doc1"]
    assert shape(got[0]["interleaved"]) == ["A cat.", (255, 0, 0), "It sleeps.", (0, 255, 0), (0, 0, 255), "The end."]
    assert got[1]["interleaved"] == [{"text": "only text"}]


def test_mmc4_published_layout_places_images_before_their_matched_passage():
    doc = {
        "text_list": ["one", "two", "three"],
        "url": "u",
        "image_info": [
            {"image_name": "x.jpg", "matched_text_index": 2, "matched_sim": 0.3},
            {"image_name": "y.jpg", "matched_text_index": 0},
            {"image_name": "z.jpg", "matched_text_index": 2},
        ],
    }
    sample = {"__key__": "k", "json": json.dumps(doc).encode(), "0.png": RED, "1.png": GREEN, "2.png": BLUE}
    items = document_items(sample, decode=wds.imagehandler("pil"))
    assert shape(items) == [(0, 255, 0), "one", "two", (255, 0, 0), (0, 0, 255), "three"]


def test_obelics_layout_with_nulls_and_an_embedded_image():
    uri = "data:image/png;base64," + base64.b64encode(BLUE).decode()
    doc = {"texts": ["hello", None, None, "bye"], "images": [None, "https://original/url.jpg", uri, None]}
    sample = {"__key__": "k", "json": json.dumps(doc).encode(), "1.png": RED}
    assert shape(document_items(sample, decode=wds.imagehandler("pil"))) == ["hello", (255, 0, 0), (0, 0, 255), "bye"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"0.png": RED}, "image 1 of the document is missing"),
        ({"0.png": RED, "1.png": GREEN, "5.jpg": BLUE}, "image field(s) 5.jpg are not named by the document"),
    ],
)
def test_missing_or_extra_images_name_the_key(fields, message):
    doc = {
        "text_list": ["a"],
        "image_info": [{"image_name": "p", "matched_text_index": 0}, {"image_name": "q", "matched_text_index": 1}],
    }
    with pytest.raises(SampleError, match=r"sample 'doc7'.*" + re.escape(message)):
        document_items(dict({"__key__": "doc7", "json": json.dumps(doc).encode()}, **fields))


def test_a_handler_skips_a_broken_document(tmp_path):
    path = str(tmp_path / "mixed.tar")
    with wds.TarWriter(path) as sink:
        sink.write(wds.interleaved_sample("good", DOC))
        broken = wds.interleaved_sample("broken", DOC)
        del broken["1.png"]
        sink.write(broken)
        sink.write(wds.interleaved_sample("good2", ["x"]))
    with pytest.raises(SampleError, match="broken"):
        read(path)
    assert [s["__key__"] for s in read(path, handler=wds.ignore_and_continue)] == ["good", "good2"]


def test_documents_batch_as_lists_or_padded_tensors_with_a_mask(tmp_path):
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "b.tar")
    with wds.TarWriter(path) as sink:
        sink.write(wds.interleaved_sample("d0", DOC))
        sink.write(wds.interleaved_sample("d1", ["text", RED]))
        sink.write(wds.interleaved_sample("d2", ["no images"]))
    samples = read(path, imagespec="torchrgb8")
    listed = wds.collate_interleaved(samples)
    assert [len(i) for i in listed["images"]] == [3, 1, 0]
    assert listed["order"][1] == ["text", "image"] and listed["texts"][2] == ["no images"]
    padded = wds.collate_interleaved(samples, pad=True)
    assert padded["images"].shape == (3, 3, 3, 3, 4) and padded["images"].dtype == torch.uint8
    assert padded["image_mask"].tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert padded["images"][1, 0, 0, 0, 0] == 255 and int(padded["images"][1, 1].sum()) == 0
    # through a loader, with the collation
    pipeline = wds.DataPipeline(
        wds.SimpleShardList([path]),
        wds.tarfile_to_samples(),
        wds.interleaved(imagespec="torchrgb8"),
        wds.batched(3, collation_fn=lambda b: wds.collate_interleaved(b, pad=True)),
    )
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=0)
    batch = next(iter(loader))
    assert batch["image_mask"].sum() == 4


def test_images_of_different_shapes_cannot_be_padded():
    pytest.importorskip("torch")
    import numpy as np

    samples = [{"interleaved": [{"image": np.zeros((3, 2, 2))}]}, {"interleaved": [{"image": np.zeros((3, 4, 4))}]}]
    with pytest.raises(SampleError, match="resize them in a map stage"):
        wds.collate_interleaved(samples, pad=True)


# the MMC4 converter
@pytest.fixture
def mmc4(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name, data in (("a.png", RED), ("b.png", GREEN), ("c.png", BLUE)):
        (images / name).write_bytes(data)
    docs = []
    for i in range(7):
        infos = [{"image_name": "a.png", "matched_text_index": 0, "raw_url": "http://dead"}]
        if i % 2:
            infos.append({"image_name": "c.png", "matched_text_index": 1})
        if i == 3:
            infos.append({"image_name": "gone.jpg", "matched_text_index": 1})
        docs.append({"text_list": [f"doc {i} first", f"doc {i} second"], "image_info": infos, "url": f"http://{i}"})
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    return tmp_path, str(jsonl), str(images)


def test_convert_mmc4_writes_shards_that_read_back(mmc4):
    root, jsonl, images = mmc4
    counts = convert_mmc4([jsonl], images, str(root / "out-%03d.tar"), maxcount=3)
    assert counts == {
        "documents": 7,
        "images": 10,
        "dropped_images": 1,
        "skipped_documents": 0,
        "written": 3,
        "kept": 0,
        "shards": 3,
    }
    got = list(
        wds.DataPipeline(
            wds.SimpleShardList([str(root / f"out-{i:03d}.tar") for i in range(3)]),
            wds.tarfile_to_samples(),
            wds.interleaved(),
        )
    )
    assert len(got) == 7
    assert shape(got[1]["interleaved"]) == [(255, 0, 0), "doc 1 first", (0, 0, 255), "doc 1 second"]
    assert shape(got[3]["interleaved"]) == [(255, 0, 0), "doc 3 first", (0, 0, 255), "doc 3 second"]


def test_convert_mmc4_resumes_keeping_the_shards_already_published(mmc4):
    root, jsonl, images = mmc4
    dest = str(root / "out-%03d.tar")
    convert_mmc4([jsonl], images, dest, maxcount=3)
    first = (root / "out-000.tar").read_bytes()
    (root / "out-002.tar").unlink()  # as if the run had stopped before publishing the last shard
    (root / "images" / "a.png").unlink()  # a kept shard's images are not read again
    counts = convert_mmc4([jsonl], images, dest, maxcount=3)
    assert (counts["kept"], counts["written"]) == (2, 1)
    assert (root / "out-000.tar").read_bytes() == first and (root / "out-002.tar").exists()


def test_convert_mmc4_stops_on_a_missing_image_when_told_and_publishes_no_partial_shard(mmc4):
    root, jsonl, images = mmc4
    with pytest.raises(SampleError, match="document 3: image 'gone.jpg' does not exist"):
        convert_mmc4([jsonl], images, str(root / "e-%03d.tar"), maxcount=3, missing="error")
    assert (root / "e-000.tar").exists() and not (root / "e-001.tar").exists()
    counts = convert_mmc4([jsonl], images, str(root / "s-%03d.tar"), maxcount=3, missing="skip")
    assert counts["skipped_documents"] == 1 and counts["documents"] == 6


def test_convert_mmc4_command(mmc4):
    root, jsonl, images = mmc4
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "wds_cloud",
            "convert",
            "mmc4",
            jsonl,
            "--images",
            images,
            "--dest",
            str(root / "cli-%03d.tar"),
            "--maxcount",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["shards"] == 2
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "wds_cloud",
            "convert",
            "mmc4",
            jsonl,
            "--images",
            images,
            "--dest",
            str(root / "nopattern.tar"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "%d-style field" in bad.stderr
