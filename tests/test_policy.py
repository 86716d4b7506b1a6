"""Policy files (the original Mesa text format), deploy_on_init / deploy_on_epoch, conversion of
nn models (convert_by_num_groups / convert_by_group_size) and the configs/mesa policies."""
import copy
import glob
import math
import os

import pytest
import torch
import torch.nn as nn

import mesa_ops as ms
from mesa_ops.policy import PolicyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "mesa")
PAPER_TAGS = {"fc", "matmul", "gelu", "layernorm", "softmax"}

README_POLICY = """\
on gelu: # layer tag, choices: fc, conv, gelu, bn, relu, softmax, matmul, layernorm
    by_index: all # layer index
    enable: True # enable for compressing
    level: 256 # we adopt 8-bit quantization by default
    ema_decay: 0.9 # the decay rate for running estimates

    by_index: 1 2 # e.g. exluding GELU layers that indexed by 1 and 2.
    enable: False
"""


def write(tmp_path, text, name="policy.txt"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---- a small ViT-like model: nn layers + the functional attention set up by hand ------------
class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.qk = ms.MatMul(quant_groups=heads)       # q @ k^T, as the original README says
        self.softmax = ms.Softmax(dim=-1, quant_groups=heads)
        self.av = ms.MatMul(quant_groups=heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = self.softmax(self.qk(q * self.scale, k.transpose(-2, -1)))
        return self.proj(self.av(attn, v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, dim=16, heads=2, depth=2, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.norm_pre = nn.LayerNorm(dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.norm_pre(self.patch(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(self.blocks(x)).mean(1))


def tiny_vit(groups=2):
    return ms.policy.convert_by_num_groups(TinyViT(), groups)


def layers_by_tag(model):
    out = {}
    for _, m in ms.policy.mesa_layers(model):
        out.setdefault(m.tag, []).append(m)
    return out


class ConvNet(nn.Module):
    """Every nn layer type Mesa converts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.gelu = nn.GELU()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))            # (B, 8, H, W)
        x = self.ln(x.flatten(2).transpose(1, 2))       # (B, HW, 8)
        return self.softmax(self.gelu(self.fc(x)))


# ---- parsing --------------------------------------------------------------------------------
def test_readme_example_parses_and_deploys(tmp_path):
    path = write(tmp_path, README_POLICY)
    assert ms.policy.read_policy(path, "gelu") == [
        {"trigger": []},
        {"by_index": "all", "enable": True, "level": 256, "ema_decay": 0.9},
        {"by_index": [1, 2], "enable": False},
    ]
    assert ms.policy.read_policy(path, "fc") == []
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(4)])
    ms.policy.convert_by_num_groups(model, 2)
    ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    gelus = [m for m in model.modules() if isinstance(m, ms.GELU)]
    assert [g.index for g in gelus] == [0, 1, 2, 3]
    assert [g.enable for g in gelus] == [True, False, False, True]
    assert all(g.level == 256 and g.bits == 8 and g.ema_decay == 0.9 for g in gelus)
    assert not any(m.enable for m in model.modules() if isinstance(m, ms.Linear))


def test_index_assignment_per_tag_in_module_order(tmp_path):
    model = tiny_vit()
    path = write(tmp_path, "on fc:\n  by_index: all\n  enable: True\n")
    ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    order = {}
    for name, m in model.named_modules():
        if isinstance(m, ms.MESA_LAYERS):
            assert m.index == order.get(m.tag, 0), (name, m.tag, m.index)
            assert m.layer_name == name
            order[m.tag] = order.get(m.tag, 0) + 1
    assert order == {"conv": 1, "layernorm": 6, "fc": 9, "matmul": 4, "softmax": 2, "gelu": 2}
    # MatMul / Softmax index both their quantizers
    mm = model.blocks[1].attn.av
    assert mm.index == 3 and mm.quant1.index == 3 and mm.quant2.index == 3


def test_later_blocks_override_for_their_indices(tmp_path):
    model = tiny_vit()
    path = write(tmp_path, """
on fc:
    by_index: all
    enable: True
    bits: 8
    by_index: 0 2      # 4-bit for these
    bits: 4
    by_index: 2, 3     # and off for these (index 2: last block wins)
    enable: False
on layernorm:
    by_index: all
    enable: True
    by_index: 5
    enable: False
""")
    ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    fcs = layers_by_tag(model)["fc"]
    assert [m.enable for m in fcs] == [True, True, False, False] + [True] * 5
    assert [m.bits for m in fcs] == [4, 8, 4, 8] + [8] * 5
    assert [m.enable for m in layers_by_tag(model)["layernorm"]] == [True] * 5 + [False]
    assert not any(m.enable for t in ("gelu", "matmul", "softmax", "conv")
                   for m in layers_by_tag(model)[t])
    # an index the model does not have is reported (not an error)
    msgs = []
    ms.policy.deploy_on_init(model, write(tmp_path, "on gelu:\n by_index: 1 9\n enable: True\n",
                                          "extra.txt"), verbose=msgs.append)
    assert any(":2: by_index [9] matches no 'gelu' layer (the model has 2)" in m for m in msgs), msgs
    assert [m.enable for m in layers_by_tag(model)["gelu"]] == [False, True]


def test_level_and_bits(tmp_path):
    model = tiny_vit()
    path = write(tmp_path, """
on gelu:
    by_index: 0
    enable: True
    level: 16
    by_index: 1
    enable: True
    bits: 2
on softmax:
    by_index: all
    enable: True
    level: 4
""")
    ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    g0, g1 = layers_by_tag(model)["gelu"]
    assert (g0.bits, g0.level) == (4, 16)
    assert (g1.bits, g1.level) == (2, 4)
    for s in layers_by_tag(model)["softmax"]:
        assert s.bits == s.quant1.bits == s.quant2.bits == 2 and s.level == 4


def test_quant_groups_key_and_by_tag_sub_quantizer(tmp_path):
    model = tiny_vit()
    path = write(tmp_path, """
on matmul:
    by_index: all
    enable: True
    quant_groups: 1
    by_index: 0 1
    by_tag: matmul-2   # only the second input's quantizer
    bits: 4
""")
    ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    mms = layers_by_tag(model)["matmul"]
    assert all(m.quant1.quant_groups == m.quant2.quant_groups == 1 for m in mms)
    assert all(m.quant1.clip_val.shape == (1,) for m in mms)
    assert [(m.quant1.bits, m.quant2.bits) for m in mms] == [(8, 4), (8, 4), (8, 8), (8, 8)]


def test_original_ignored_keys_accepted(tmp_path):
    # the demo projects' policies (deit-mesa) carry keys of the original code that did nothing
    path = write(tmp_path, """
on fc:
  by_index: all
  enable: True
  level: 256
  stable: -1
  ema_decay: 0.9
  fp_forward: True

on softmax:
  by_index: all
  enable: True
  level: 256

  by_index: all
  by_tag: softmax-2
  non_negative_only: True
""")
    model = tiny_vit()
    ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    assert all(m.enable for m in layers_by_tag(model)["fc"])
    assert all(m.enable for m in layers_by_tag(model)["softmax"])


BAD = [
    ("missing colon", "on fc:\n    by_index all\n", 2, "missing ':'"),
    ("unknown tag", "on attn:\n    by_index: all\n    enable: True\n", 1, "tag"),
    ("key before by_index", "on fc:\n    enable: True\n", 2, "expected 'by_index:'"),
    ("no section", "by_index: all\nenable: True\n", 1, "section header"),
    ("bad level", "on fc:\n    by_index: all\n    level: 100\n", 3, "bad value for 'level'"),
    ("bad bits", "on fc:\n    by_index: all\n    bits: 3\n", 3, "bad value for 'bits'"),
    ("bad bool", "on fc:\n    by_index: all\n    enable: yes\n", 3, "bad value for 'enable'"),
    ("bad decay", "on fc:\n    by_index: all\n    ema_decay: 1.5\n", 3, "bad value for 'ema_decay'"),
    ("unknown key", "on fc:\n    by_index: all\n    enable: True\n    bitz: 4\n", 4,
     "unknown key 'bitz'"),
    ("empty by_index", "on fc:\n    by_index:\n    enable: True\n", 2, "by_index"),
    ("bad by_index", "on fc:\n    by_index: one two\n    enable: True\n", 2, "by_index"),
    ("block sets nothing", "on fc:\n    by_index: all\n    enable: True\n    by_index: 1\n"
     "on gelu:\n    by_index: all\n    enable: True\n", 4, "sets nothing"),
    ("bad trigger", "on fc: ten\n    by_index: all\n    enable: True\n", 1, "trigger"),
    ("duplicate section", "on fc:\n    by_index: all\n    enable: True\non fc:\n", 4, "twice"),
    ("by_tag after settings", "on fc:\n    by_index: all\n    enable: True\n    by_tag: fc\n", 4,
     "by_tag"),
]


@pytest.mark.parametrize("what,text,line,expect", BAD, ids=[b[0] for b in BAD])
def test_malformed_file_names_file_and_line(tmp_path, what, text, line, expect):
    path = write(tmp_path, text, name="bad_policy.txt")
    model = tiny_vit()
    before = {n: (m.enable, m.bits) for n, m in ms.policy.mesa_layers(model)}
    with pytest.raises(PolicyError) as exc:
        ms.policy.deploy_on_init(model, path, verbose=lambda *a: None)
    msg = str(exc.value)
    assert f"{path}:{line}:" in msg, msg
    assert expect in msg, msg
    # nothing was changed: the whole file is checked first
    assert before == {n: (m.enable, m.bits) for n, m in ms.policy.mesa_layers(model)}
    with pytest.raises(PolicyError):
        ms.policy.read_policy(path, "fc")


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="not found"):
        ms.policy.deploy_on_init(tiny_vit(), str(tmp_path / "nope.txt"))


# ---- deploy_on_epoch, verbose -----------------------------------------------------------------
def test_deploy_on_epoch_with_triggers(tmp_path):
    path = write(tmp_path, """
on gelu: 2 4
    by_index: all
    enable: True
    bits: 4
    by_index: 1
    enable: False
on fc: 3
    by_index: 0
    enable: True
""")
    model = tiny_vit()
    ms.policy.deploy_on_init(model, write(tmp_path, "on conv:\n by_index: all\n enable: False\n",
                                          "init.txt"), verbose=lambda *a: None)
    gelu_pol = ms.policy.read_policy(path, "gelu")
    assert gelu_pol[0] == {"trigger": [2, 4]}
    fc_pol = ms.policy.read_policy(path, "fc")
    assert fc_pol[0] == {"trigger": [3]}
    gelus, fcs = layers_by_tag(model)["gelu"], layers_by_tag(model)["fc"]
    msgs = []
    for epoch in range(2):
        ms.policy.deploy_on_epoch(model, gelu_pol, epoch, verbose=msgs.append)
        ms.policy.deploy_on_epoch(model, fc_pol, epoch, verbose=msgs.append)
    assert msgs == []
    assert not any(m.enable for _, m in ms.policy.mesa_layers(model))
    ms.policy.deploy_on_epoch(model, gelu_pol, 2, verbose=msgs.append)
    assert [(g.enable, g.bits) for g in gelus] == [(True, 4), (False, 4)]
    # the gelu section touched gelu layers only (the original applied it to every tag)
    assert not any(m.enable for m in fcs)
    assert len(msgs) == 1 and "epoch 2" in msgs[0]
    ms.policy.deploy_on_epoch(model, fc_pol, 3, verbose=msgs.append)
    assert [m.enable for m in fcs] == [True] + [False] * 8
    # a hand-built list (no tag) applies to all Mesa layers, as the original
    ms.policy.deploy_on_epoch(model, [{"trigger": [7]}, {"by_index": "all", "enable": False}], 7,
                              verbose=msgs.append)
    assert not any(m.enable for _, m in ms.policy.mesa_layers(model))
    with pytest.raises(PolicyError, match="trigger"):
        ms.policy.deploy_on_epoch(model, [{"by_index": "all", "enable": True}], 0)
    ms.policy.deploy_on_epoch(model, [], 0)  # nothing to do
    ms.policy.deploy_on_iteration(model, gelu_pol, 4, verbose=msgs.append)
    assert gelus[0].enable and not gelus[1].enable


def test_update_quantization_parameter_accepts_original_string_values():
    model = tiny_vit()
    ms.policy.assign_indices(model)
    fcs = layers_by_tag(model)["fc"]
    for m in fcs:  # what the original read_policy produced: strings and lists of strings
        m.update_quantization_parameter(by_index=["1", "2"], enable="True", level="16",
                                        ema_decay="0.5")
    assert [m.enable for m in fcs[:4]] == [False, True, True, False]
    assert fcs[1].bits == 4 and fcs[1].ema_decay == 0.5 and fcs[0].bits == 8
    for m in fcs:
        m.update_quantization_parameter(by_index="0 3", by_tag="fc", enable=True)
    assert [m.enable for m in fcs[:4]] == [True, True, True, True]
    with pytest.raises(PolicyError, match="level"):
        fcs[0].update_quantization_parameter(by_index="all", level=100)
    with pytest.raises(PolicyError, match="unknown policy key"):
        fcs[0].update_quantization_parameter(by_index="all", colour="red")
    fcs[0].update_quantization_parameter(index=42)
    assert fcs[0].index == 42


def test_override_verbose(tmp_path, capsys, caplog):
    path = write(tmp_path, README_POLICY)
    model = tiny_vit()
    msgs = []
    with caplog.at_level("INFO", logger="mesa_ops"):
        ms.policy.deploy_on_init(model, path, verbose=msgs.append, override_verbose=False)
    # without override: the summary goes to verbose, per-setting messages to the logger
    assert any("gelu: 1/2 layers enabled" in m for m in msgs), msgs
    assert not any(m.startswith("update ") for m in msgs)
    assert any("update gelu_enable" in r.getMessage() for r in caplog.records)
    assert capsys.readouterr().out == ""

    model, msgs = tiny_vit(), []
    ms.policy.deploy_on_init(model, path, verbose=msgs.append, override_verbose=True)
    assert "update gelu_enable to True for index 0" in msgs
    assert "update gelu_enable to False for index 1" in msgs
    assert capsys.readouterr().out == ""
    # the layers keep the new verbose for later policy updates (MatMul/Softmax quantizers too)
    msgs.clear()
    ms.policy.set_mesa(model, True, 4, tags=["matmul"])
    assert any(m.startswith("update matmul_bits to 4") for m in msgs), msgs
    assert model.blocks[0].attn.qk.quant1.verbose == msgs.append


# ---- conversion -----------------------------------------------------------------------------
def test_convert_recognises_nn_layers_and_keeps_parameters_and_buffers():
    model = ConvNet()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        model.bn.running_mean.uniform_()
        model.bn.num_batches_tracked.fill_(7)
    rm = model.bn.running_mean.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the conversion
    out = ms.policy.convert_by_num_groups(model, 1)
    assert out is model
    kinds = {"conv": ms.Conv2d, "bn": ms.BatchNorm2d, "relu": ms.ReLU, "ln": ms.LayerNorm,
             "fc": ms.Linear, "gelu": ms.GELU, "softmax": ms.Softmax}
    for name, cls in kinds.items():
        assert type(getattr(model, name)) is cls, name
        assert not getattr(model, name).enable  # compression stays off until a policy
    new_params = dict(model.named_parameters())
    assert new_params.keys() == params.keys()
    assert all(new_params[k] is params[k] for k in params)  # the same Parameter objects
    new_buffers = dict(model.named_buffers())
    for k, b in buffers.items():
        assert new_buffers[k] is b, k
    assert torch.equal(model.bn.running_mean, rm) and int(model.bn.num_batches_tracked) == 7
    assert model.softmax.dim == -1
    # the optimizer built before conversion updates the converted layers
    w0 = model.fc.weight.detach().clone()
    model(torch.randn(2, 3, 4, 4)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(model.fc.weight, w0)


def test_convert_is_idempotent():
    model = ms.policy.convert_by_num_groups(ConvNet(), 1)
    mods = dict(model.named_modules())
    keys = list(model.state_dict())
    ms.policy.convert_by_num_groups(model, 4)
    ms.policy.convert_by_group_size(model, 2)
    assert all(dict(model.named_modules())[k] is m for k, m in mods.items())
    assert list(model.state_dict()) == keys
    assert model.fc.quant_groups == 1


@pytest.mark.parametrize("enable", [False, True], ids=["mesa-off", "mesa-8bit"])
def test_convert_leaves_eval_and_train_outputs_unchanged(enable):
    x = torch.randn(2, 3, 8, 8)
    for make in (ConvNet, TinyViT):
        torch.manual_seed(1)
        plain = make()
        model = copy.deepcopy(plain)
        ms.policy.convert_by_num_groups(model, 1)
        ms.policy.set_mesa(model, enable=enable, bits=8)
        for mode in ("eval", "train"):
            getattr(plain, mode)()
            getattr(model, mode)()
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = plain(xa), model(xb)
            assert torch.equal(ya, yb), (make.__name__, mode)
            if mode == "train":
                w = torch.randn_like(ya)  # not .sum(): the sum of a softmax has no gradient
                (ya * w).sum().backward()
                (yb * w).sum().backward()
                assert xb.grad is not None and torch.isfinite(xb.grad).all()
                if not enable:
                    assert torch.equal(xa.grad, xb.grad)
                else:  # 8-bit saved activations: close gradients
                    rel = (xa.grad - xb.grad).norm() / xa.grad.norm()
                    assert rel < 0.1, rel
        if make is ConvNet:  # BatchNorm running statistics updated the same way
            assert torch.equal(plain.bn.running_mean, model.bn.running_mean)
            assert torch.equal(plain.bn.running_var, model.bn.running_var)


def test_convert_by_group_size():
    model = TinyViT(dim=16, heads=2)
    ms.policy.convert_by_group_size(model, 4)
    assert model.patch.quant_groups == 1            # 3 input channels <= 4: one group
    assert model.norm.quant_groups == 16 // 4
    attn = model.blocks[0].attn
    assert attn.qkv.quant_groups == 4 and model.blocks[0].mlp[2].quant_groups == 64 // 4
    gelu = model.blocks[0].mlp[1]
    assert isinstance(gelu, ms.GELU) and gelu.group_size == 4
    ms.policy.set_mesa(model, True, 8)
    model.train()(torch.randn(2, 3, 8, 8)).sum().backward()
    assert gelu.quant_groups == 64 // 4 and gelu.clip_val.shape == (16,)  # derived at run time
    # an nn.Softmax converted by group size: one group per head
    sm = ms.policy.convert_by_group_size(nn.Softmax(dim=-1), 4)
    assert isinstance(sm, ms.Softmax)
    sm.enable = True
    sm.train()(torch.randn(2, 3, 5, 5, requires_grad=True)).sum().backward()
    assert sm.quant2.quant_groups == 3  # quant2 stores the output (quant1 is unused)
    with pytest.raises(PolicyError, match="does not divide"):
        ms.policy.convert_by_group_size(nn.Sequential(nn.Linear(24, 4)), 16)


def test_convert_preserves_device_and_dtype():
    model = TinyViT().to(torch.float64)
    ms.policy.convert_by_num_groups(model, 2)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ms.policy.set_mesa(model, True, 8, tags=PAPER_TAGS)  # (2 groups do not divide 3 image channels)
    y = model.train()(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert y.dtype == torch.float64
    y.sum().backward()
    net = ConvNet().double()
    ms.policy.convert_by_num_groups(net, 1)
    assert net.bn.running_mean.dtype == torch.float64 and net.conv.weight.dtype == torch.float64
    if torch.cuda.is_available():
        model = ms.policy.convert_by_num_groups(TinyViT().cuda().half(), 2)
        for m in model.modules():
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                assert t.is_cuda
        assert all(p.dtype == torch.float16 for p in model.parameters())


def test_convert_meta_model_stays_meta():
    with torch.device("meta"):
        model = TinyViT()
    ms.policy.convert_by_num_groups(model, 2)
    assert isinstance(model.head, ms.Linear) and model.head.weight.is_meta


def test_convert_leaves_subclasses_with_own_forward():
    class LayerNorm2d(nn.LayerNorm):  # NCHW layer norm (as timm's): a different op
        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    class PlainSubclass(nn.Linear):  # keeps nn.Linear.forward
        pass

    model = nn.Sequential(LayerNorm2d(4), PlainSubclass(4, 4),
                          nn.MultiheadAttention(4, 2))
    x = torch.randn(1, 4, 2, 2)
    y0 = model[0](x)
    ms.policy.convert_by_num_groups(model, 1)
    assert type(model[0]) is LayerNorm2d and torch.equal(model[0](x), y0)
    assert type(model[1]) is ms.Linear
    # nn.MultiheadAttention: out_proj (a Linear subclass) converted, the module still works
    mha = model[2]
    assert isinstance(mha.out_proj, ms.Linear)
    q = torch.randn(3, 1, 4)
    assert mha(q, q, q)[0].shape == (3, 1, 4)


def test_convert_root_layer_returns_mesa_layer():
    lin = nn.Linear(6, 3)
    new = ms.policy.convert_by_num_groups(lin, 3)
    assert type(new) is ms.Linear and new.weight is lin.weight and new.quant_groups == 3


# ---- configs/mesa -----------------------------------------------------------------------------
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIGS, "*.txt")))
EXPECTED = {  # file -> (bits, tags enabled)
    "mesa_8bit.txt": (8, PAPER_TAGS),
    "mesa_4bit.txt": (4, PAPER_TAGS),
    "mesa_2bit.txt": (2, PAPER_TAGS),
    "swin_8bit.txt": (8, PAPER_TAGS),
    "pvt_8bit.txt": (8, PAPER_TAGS | {"conv"}),
}


def test_configs_present():
    assert {os.path.basename(f) for f in CONFIG_FILES} == set(EXPECTED)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_parses_and_enables_intended_tags(path):
    name = os.path.basename(path)
    bits, tags = EXPECTED[name]
    text = open(path).read()
    assert text.lstrip().startswith("#") and text.count("#") > 5  # commented
    sections = ms.policy.parse_policy(path)
    assert tags <= set(sections)
    model = tiny_vit()
    msgs = []
    ms.policy.deploy_on_init(model, path, verbose=msgs.append)
    by_tag = layers_by_tag(model)
    for tag, layers_ in by_tag.items():
        for m in layers_:
            want = tag in tags and not (name == "swin_8bit.txt" and tag == "layernorm"
                                        and m.index == 0) and not (
                name == "pvt_8bit.txt" and tag == "conv" and m.index == 0)
            assert m.enable == want, (name, tag, m.index)
            if m.enable:
                assert m.bits == bits and m.ema_decay == 0.9
                if hasattr(m, "quant1"):
                    assert m.quant1.enable and m.quant2.enable and m.quant2.bits == bits
    if name == "swin_8bit.txt":
        lns = by_tag["layernorm"]
        assert not lns[0].enable and all(m.enable for m in lns[1:])
    # it trains
    model.train()(torch.randn(2, 3, 8, 8)).sum().backward()


def test_readme_usage_end_to_end_timm_deit():
    """The original README's usage, unchanged, on timm's DeiT-Tiny (img_size 32)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32,
                              num_classes=10)
    plain = copy.deepcopy(model)
    params = list(model.parameters())
    ms.policy.convert_by_num_groups(model, 3)
    ms.policy.deploy_on_init(model, os.path.join(CONFIGS, "mesa_8bit.txt"), verbose=lambda *a: None,
                             override_verbose=False)
    assert all(a is b for a, b in zip(params, model.parameters()))
    by_tag = layers_by_tag(model)
    assert len(by_tag["fc"]) == 12 * 4 + 1 and all(m.enable for m in by_tag["fc"])
    assert len(by_tag["layernorm"]) == 12 * 2 + 1 and all(m.enable for m in by_tag["layernorm"])
    assert len(by_tag["gelu"]) == 12 and all(m.enable for m in by_tag["gelu"])
    assert not by_tag["conv"][0].enable
    # timm's Attention uses F.scaled_dot_product_attention: no MatMul/Softmax modules there
    assert "matmul" not in by_tag and "softmax" not in by_tag

    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    plain.eval(), model.eval()
    assert torch.equal(plain(x), model(x))  # eval outputs unchanged
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    plain.train()
    with ms.SavedActivationMeter(plain) as exact:
        plain(x).sum()
    with ms.SavedActivationMeter(model) as mesa:
        model(x).sum()
    print(f"\ntimm deit_tiny img 32, batch 4: saved {mesa.total_bytes} B with mesa_8bit vs "
          f"{exact.total_bytes} B exact ({mesa.total_bytes / exact.total_bytes:.3f}x)")
    assert mesa.total_bytes < 0.6 * exact.total_bytes


# ---- issue 22 (Also): the summary names each attention's path -------------------------------
def test_policy_summary_prints_each_attention_path(tmp_path):
    """The default 8-bit policy runs the fused Mesa SDPA (no N x N matrix, no warning); a
    matmul-only policy (the paper's ablations) takes the explicit path with the softmax off, and
    the summary warns that it stores the N x N softmax output at full precision; the warning is
    true: that model saves more bytes than the exact (fused SDPA) one."""
    import models

    def build(policy):
        torch.manual_seed(0)
        m = models.create_model("deit_tiny_patch16_224", img_size=32, depth=2, drop_path_rate=0.0).train()
        msgs = []
        if policy is not None:
            ms.policy.deploy_on_init(m, policy, verbose=msgs.append)
        return m, msgs

    def saved(m):
        with ms.SavedActivationMeter(m) as meter:
            m(torch.randn(2, 3, 32, 32)).sum().backward()
        return meter.total_bytes

    m8, msgs = build("configs/mesa/mesa_8bit.txt")
    paths = [x for x in msgs if "attention path" in x]
    assert paths == ["mesa policy: attention path: fused Mesa SDPA (q, k, v, out packed, no N x N matrix): "
                     "blocks.0.attn, blocks.1.attn"], msgs
    assert not any("WARNING" in x for x in msgs)
    assert all(b.attn.attention_path() == "mesa-sdpa" for b in m8.blocks)

    mm, msgs = build(write(tmp_path, "on matmul:\n by_index: all\n enable: True\n level: 256\n", "mm.txt"))
    paths = [x for x in msgs if "attention path" in x]
    assert paths == ["mesa policy: attention path: explicit q@k / softmax / attn@v (Mesa matmul / softmax): "
                     "blocks.0.attn, blocks.1.attn"], msgs
    warn = [x for x in msgs if "WARNING" in x]
    assert len(warn) == 1 and "2 attention module(s)" in warn[0] and "N x N softmax output" in warn[0]
    assert all(b.attn.attention_path() == "mesa-explicit" for b in mm.blocks)
    exact, _ = build(None)
    assert all(b.attn.attention_path() == "sdpa" for b in exact.blocks)


def test_matmul_only_policy_stores_more_attention_bytes_than_exact_sdpa(tmp_path):
    """The warning's figure: DeiT-Ti at 224 px (N = 197), batch 2, one block: the explicit path
    of a matmul-only policy stores the (2, 3, 197, 197) fp32 softmax output (931416 bytes) and
    its attention ops store more than exact fused SDPA's q, k, v, out and logsumexp."""
    import models

    def attention_bytes(policy):
        torch.manual_seed(0)
        m = models.create_model("deit_tiny_patch16_224", depth=1, drop_path_rate=0.0).train()
        if policy is not None:
            ms.policy.deploy_on_init(m, policy, verbose=lambda *a: None)
        with ms.SavedActivationMeter(m) as meter:
            m(torch.randn(2, 3, 224, 224)).sum().backward()
        return {k: v for k, v in meter.by_type.items() if k in ("Attention", "MatMul", "Softmax", "SDPA")}

    exact = attention_bytes(None)
    mm = attention_bytes(write(tmp_path, "on matmul:\n by_index: all\n enable: True\n level: 256\n", "mm.txt"))
    assert set(exact) == {"Attention"} and set(mm) == {"MatMul", "Softmax"}
    assert mm["Softmax"] == 2 * 3 * 197 * 197 * 4
    assert sum(mm.values()) > exact["Attention"]
