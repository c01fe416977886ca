"""A user's own stage takes part in resume through the public Resumable protocol (docs/stages.md)."""

from __future__ import annotations

import pathlib
import re

import pytest

import wds_cloud as wds
from wds_cloud.writer import ShardWriter

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "stages.md"


def _example() -> dict:
    """The python block of docs/stages.md that defines ``EveryNth``, executed: the worked example users read."""
    code = next(
        block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "class EveryNth" in block
    )
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


@pytest.fixture
def urls(tmp_path):
    with ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=7) as sink:
        for i in range(40):
            sink.write({"__key__": f"{i:03d}", "txt": str(i)})
    return sorted(str(p) for p in tmp_path.glob("s-*.tar"))


def _keys(samples):
    return [s["__key__"] for s in samples]


def test_documented_stage_is_resumable_and_resumes_exactly(urls):
    """EveryNth from docs/stages.md is a Resumable; a state taken mid-epoch resumes to the same rest."""
    EveryNth = _example()["EveryNth"]
    assert isinstance(EveryNth(3), wds.Resumable)

    def build():
        return wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), EveryNth(3))

    whole = _keys(build())
    assert whole == [f"{i:03d}" for i in range(2, 40, 3)]
    for cut in range(len(whole)):
        pipeline = build()
        it = iter(pipeline)
        head = [next(it)["__key__"] for _ in range(cut)]
        state = pipeline.state_dict()
        assert [entry[1] for entry in state["stages"]][-1] == "EveryNth"
        resumed = build()
        resumed.load_state_dict(state)
        assert head + _keys(resumed) == whole


def test_documented_stage_refuses_a_state_it_did_not_save(urls):
    """load_state_dict of the example checks its input and raises StateMismatchError."""
    EveryNth = _example()["EveryNth"]
    with pytest.raises(wds.StateMismatchError):
        EveryNth(3).load_state_dict({"n": 4, "seen": 1})


class _Holding:
    """A stage that keeps samples back and says it cannot be resumed."""

    resumable = False

    def __call__(self, src):
        held = []
        for sample in src:
            held.append(sample)
            if len(held) == 2:
                yield from held
                held = []
        yield from held


def test_a_stage_declaring_itself_not_resumable_iterates_and_only_state_dict_raises(urls):
    """resumable = False: the pipeline iterates as before; its state is inexact and names the stage, and
    state_dict(strict=True) raises naming it."""
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), _Holding())
    assert len(list(pipeline)) == 40
    with pytest.raises(wds.NotResumableError, match=r"stage 2 \(_Holding\)"):
        pipeline.state_dict(strict=True)
    assert "stage 2 (_Holding)" in pipeline.state_dict()["inexact"]


def test_a_stage_declaring_itself_not_resumable_iterates_through_webloader(urls):
    """Through WebLoader (no workers) the same pipeline iterates; its state names the stage."""
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), _Holding())
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=0)
    assert len(list(loader)) == 40
    with pytest.raises(wds.NotResumableError, match="_Holding"):
        loader.state_dict(strict=True)
    assert "_Holding" in loader.state_dict()["inexact"] and loader.resume_blocker()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_documented_stage_resumes_through_webloader_workers(urls, num_workers):
    """EveryNth inside a WebDataset resumes exactly through WebLoader, with and without DataLoader workers."""
    pytest.importorskip("torch")
    EveryNth = _example()["EveryNth"]

    def loader():
        ds = wds.WebDataset(urls, shardshuffle=False).compose(EveryNth(2)).to_tuple("__key__")
        return wds.WebLoader(ds, batch_size=None, num_workers=num_workers)

    full = [k for (k,) in loader()]
    assert len(full) == 20 if num_workers == 0 else len(full) > 0
    for cut in (1, len(full) // 2, len(full) - 1):
        first = loader()
        it = iter(first)
        head = [next(it)[0] for _ in range(cut)]
        state = first.state_dict()
        del it
        second = loader()
        second.load_state_dict(state)
        assert head + [k for (k,) in second] == full
