"""Review of coat.SideTuned: refusals leave the base untouched, incremental decoding is refused
rather than silently wrong, and save/load refuse what does not match (CPU path)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_side_tuning import _base, _ids

from coat.nn import adapters
from coat.side_tuning import SideTuned


def _untouched(base) -> bool:
    return all(p.requires_grad for p in base.parameters()) and not any(adapters.is_frozen_fp8(m) for m in base.modules())


@pytest.mark.parametrize("kw", [dict(r=4, num_heads=5), dict(r=4, intermediate_size=0)])
def test_refused_arguments_leave_the_base_untouched(kw):
    base = _base()
    with pytest.raises(ValueError, match="num_heads|intermediate_size"):
        SideTuned(base, **kw)
    assert _untouched(base)


def test_the_forward_refuses_a_cache(gen):
    """The forward recomputes the whole sequence: a cache handed to it is refused, not ignored (cached
    decoding is ``generate``'s: test_side_tuning.py)."""
    st = SideTuned(_base(), r=4)
    ids = _ids(gen)
    with pytest.raises(ValueError, match="past_key_values"):
        st(ids[:, -1:], past_key_values=object())
    with pytest.raises(ValueError, match="use_cache"):
        st(ids, use_cache=True)
    with pytest.raises(ValueError, match="inputs_embeds"):
        st(ids, inputs_embeds=torch.zeros(2, 11, 48))
    with torch.no_grad():  # what stays accepted: use_cache off, and the Trainer's keywords
        a = st(ids, use_cache=False).logits
        b = st(ids, past_key_values=None, use_cache=None).logits
    assert torch.equal(a, b)


def _saved(tmp_path, gen):
    base = _base()
    fresh = copy.deepcopy(base)
    st = SideTuned(base, r=4, downsample=8)
    st.save_side(tmp_path / "side")
    return tmp_path / "side", fresh


def test_load_side_refuses_bad_weights_before_touching_the_base(tmp_path, gen):
    folder, fresh = _saved(tmp_path, gen)
    tensors = load_file(folder / "side_model.safetensors")
    name = "up.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, folder / "side_model.safetensors")
    with pytest.raises(ValueError, match="up.weight"):
        SideTuned.load_side(folder, fresh)
    assert _untouched(fresh)


def test_load_side_refuses_non_float_weights(tmp_path, gen):
    folder, fresh = _saved(tmp_path, gen)
    tensors = load_file(folder / "side_model.safetensors")
    tensors["top_gate"] = torch.ones_like(tensors["top_gate"], dtype=torch.int64)
    save_file(tensors, folder / "side_model.safetensors")
    with pytest.raises(ValueError, match="top_gate"):
        SideTuned.load_side(folder, fresh)
    assert _untouched(fresh)


@pytest.mark.parametrize("edit", ["no_side_layer", "side_layer_list", "eps", "r_str"])
def test_load_side_refuses_a_corrupt_config(tmp_path, gen, edit):
    folder, fresh = _saved(tmp_path, gen)
    cfg = json.loads((folder / "side_config.json").read_text())
    if edit == "no_side_layer":
        del cfg["side_layer"]
    elif edit == "side_layer_list":
        cfg["side_layer"] = [1, 2]
    elif edit == "eps":  # a side network trained with another epsilon: not this base's
        cfg["side_layer"]["rms_norm_eps"] = 0.5
    else:
        cfg["r"] = "4"
    (folder / "side_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="side_layer|rms_norm_eps|r must"):
        SideTuned.load_side(folder, fresh)
    assert _untouched(fresh)


def test_load_side_state_dict_checks_everything_before_copying(gen):
    st = SideTuned(_base(), r=4)
    state = {k: v.clone() + 1 for k, v in st.side_state_dict().items()}
    last = sorted(state)[-1]
    state[last] = state[last].reshape(-1)[:-1].clone() if state[last].numel() > 1 else torch.zeros(2)
    before = {k: v.clone() for k, v in st.side_state_dict().items()}
    with pytest.raises(ValueError, match="shape"):
        st.load_side_state_dict(state)
    after = st.side_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_save_side_writes_nothing_on_failure(tmp_path, monkeypatch, gen):
    import coat.side_tuning as side_tuning

    st = SideTuned(_base(), r=4)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(side_tuning.json, "dump", boom)
    with pytest.raises(OSError):
        st.save_side(tmp_path / "side")
    assert not (tmp_path / "side").exists() or not any((tmp_path / "side").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["side"])
    monkeypatch.undo()
    st.save_side(tmp_path / "side")  # the folder is still usable
    assert sorted(p.name for p in (tmp_path / "side").iterdir()) == ["side_config.json", "side_model.safetensors"]
