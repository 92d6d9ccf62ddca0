"""The Python examples in README.md and docs/*.md against the library as it is. Every block parses; every name it
imports from lrmoe exists; every call of an lrmoe function or class by name binds to that object's signature (a
renamed or removed argument fails here, not in a user's hands); and the self-contained examples run, with their
results checked: every README block (each a whole program, at sizes a CPU runs in seconds), and docs/memory.md's
planner. The two maps a newcomer reads first name everything they map: docs/overview.md every page of docs/,
README's layout every folder and example script.

A doc's blocks build on each other (a later block may use what an earlier one imported), so a call is checked
against the names every block of the same file imports, unless a block of that file also defines the name itself.
Not checked: calls inside comments, calls through an attribute (``lrmoe.nn.LRMoE(...)``, ``moe.stats()``), and the
keywords of a function that takes ``**options`` (``swap_experts``): any keyword binds there.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import torch

from lrmoe.functional import inclusion_probabilities

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def lrmoe_imports(codes: list[str]) -> dict[str, object]:
    """name -> object for every ``from lrmoe... import name`` in the blocks (asserting that it exists), less the
    names a block defines itself (def, class, assignment)."""
    names, defined = {}, set()
    for code in codes:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lrmoe":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name == "*":
                        names.update({k: getattr(module, k) for k in getattr(module, "__all__", [])})
                        continue
                    if not hasattr(module, alias.name):  # a submodule not imported yet
                        importlib.import_module(f"{node.module}.{alias.name}")
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                    names[alias.asname or alias.name] = getattr(module, alias.name)
    return {k: v for k, v in names.items() if k not in defined}


def signature(obj) -> inspect.Signature:
    """The signature a call of ``obj`` binds to: a torch.library custom op's is its Python function's (the op object
    itself shows (*args, **kwargs))."""
    return inspect.signature(getattr(obj, "_init_fn", obj))


def unbound_calls(code: str, names: dict[str, object]) -> tuple[int, list[str]]:
    """(calls checked, the ones that do not bind to their lrmoe object's signature, with the reason)."""
    checked, bad = 0, []
    for node in ast.walk(ast.parse(code)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue  # *args / **kwargs: what they hold is not in the text
        try:
            signature(names[node.func.id]).bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except (TypeError, ValueError) as e:  # ValueError: no signature to read
            bad.append(f"line {node.lineno}: {ast.unparse(node)[:80]}: {e}")
        checked += 1
    return checked, bad


DOC_BLOCKS = {path.relative_to(ROOT).as_posix(): python_blocks(path) for path in DOCS}


def test_the_docs_have_examples():
    assert len(DOC_BLOCKS["README.md"]) >= 2
    assert sum(len(codes) for codes in DOC_BLOCKS.values()) >= 7


@pytest.mark.parametrize("doc", [doc for doc, codes in DOC_BLOCKS.items() if codes])
def test_examples_parse_and_their_lrmoe_calls_bind(doc):
    codes = DOC_BLOCKS[doc]
    names = lrmoe_imports(codes)
    results = [unbound_calls(code, names) for code in codes]
    if doc == "README.md":
        assert sum(checked for checked, _ in results) >= 5, "README: its examples' lrmoe calls were not found"
    bad = [f"block {i}, {msg}" for i, (_, msgs) in enumerate(results, 1) for msg in msgs]
    assert not bad, f"{doc}: calls that no longer match the library:\n" + "\n".join(bad)


def test_the_signature_check_catches_a_renamed_argument():
    names = {"plan_quotas": importlib.import_module("lrmoe.functional").plan_quotas}
    assert unbound_calls("plan_quotas(loads_E, retain=0.75)", names) == (1, [])
    checked, bad = unbound_calls("plan_quotas(loads_E, retian=0.75)", names)
    assert checked == 1 and len(bad) == 1 and "retian" in bad[0]


def test_the_signature_check_reads_custom_ops_and_skips_names_a_doc_defines():
    ops = lrmoe_imports(["from lrmoe.ops import gather_sum_rows"])
    assert unbound_calls("gather_sum_rows(src, rows)", ops) == (1, [])
    checked, bad = unbound_calls("gather_sum_rows(src, rows, w, nonsense=1)", ops)
    assert checked == 1 and "nonsense" in bad[0]
    names = lrmoe_imports(["from lrmoe.functional import plan_quotas", "def plan_quotas(x):\n    return x"])
    assert "plan_quotas" not in names


def run_block(code: str, name: str) -> dict:
    """Run one block as a whole program, in an empty namespace; returns the names it left."""
    env = {}
    exec(compile(code, name, "exec"), env)
    return env


def readme_block(*needles: str) -> str:
    return next(code for code in DOC_BLOCKS["README.md"] if all(needle in code for needle in needles))


@pytest.mark.parametrize("index", range(len(DOC_BLOCKS["README.md"])))
def test_every_readme_block_is_a_small_whole_program(index):
    """Each README block runs alone, as pasted, in an empty namespace: every name it uses, it imports or defines
    (the first once used an undefined x and hf_model). And it runs at small sizes, the real ones in comments: the
    modules it builds hold under a million parameters together (its GLM-4.5 line once built a 2.2-billion-parameter
    fp32 block, 13.9 GB). Nothing is fetched: no from_pretrained outside the comments."""
    code = DOC_BLOCKS["README.md"][index]
    calls = {node.func.attr for node in ast.walk(ast.parse(code))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert "from_pretrained" not in calls
    env = run_block(code, f"README.md block {index + 1}")
    modules = [value for value in env.values() if isinstance(value, torch.nn.Module)]
    assert sum(p.numel() for module in modules for p in module.parameters()) < 1_000_000


def test_readme_layer_block_trains_its_layers_and_keeps_three_quarters_of_the_pairs(capsys):
    env = run_block(readme_block("LRMoE(", "torch.compile(", "glm"), "README.md, the layer block")
    moe, x, y, stats = env["moe"], env["x"], env["y"], env["stats"]
    assert y.shape == x.shape and stats.total_pairs == x.shape[0] * x.shape[1] * moe.top_k
    assert stats.retained_pairs == (3 * stats.total_pairs) // 4
    kept = f"{int(stats.retained_pairs)} of {int(stats.total_pairs)} token-expert pairs kept in the backward\n"
    assert capsys.readouterr().out == kept
    for layer in (moe, env["glm"]):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    assert env["glm"].gate.e_score_correction_bias.abs().sum() > 0  # update_selection_bias moved it


def test_readme_transformers_block_loads_a_block_and_swaps_the_experts(capsys):
    """The Qwen3-MoE block: the block's state_dict, loaded into LRMoE, gives the block's output; swap_experts
    names the swapped modules as its comment says, and the model's training step reaches its experts."""
    code = readme_block("Qwen3MoeConfig(", "swap_experts(")
    env = run_block(code, "README.md, the transformers block")
    assert capsys.readouterr().out == "['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']\n"
    assert "# ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']" in code
    hf_model, moe = env["hf_model"], env["moe"]
    block = hf_model.model.layers[0].mlp
    h = torch.randn(2, 8, hf_model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(h), block(h), rtol=1e-5, atol=1e-6)
    assert all(p.grad is not None for p in block.experts.parameters())


def test_readme_primitives_run_as_pasted_and_compute_the_retained_rows_input_gradient(capsys):
    """README's block of primitives, run as a whole program in an empty namespace (every name it uses, it defines):
    dphi_RF holds, for each kept pair (token t, expert e), alpha / p * (down[e]^T g_t) against a dense
    reference, zeros on the padding rows; the kept pairs are the planned quotas, 3/4 of the pairs."""
    code = readme_block("compact_and_gemm", "select_within_quota")
    env = run_block(code, "README.md, the primitives block")

    T, K, F = env["T"], env["K"], env["F"]
    sel, dphi_RF, routing = env["sel"], env["dphi_RF"], env["routing"]
    n_kept = int(sel.offsets[-1])
    assert n_kept == int(env["quotas_E"].sum()) == (3 * T * K) // 4
    assert capsys.readouterr().out == f"{n_kept} of {T * K} pairs kept, dphi_RF {tuple(dphi_RF.shape)}\n"
    assert dphi_RF.shape == (env["R"], F) and env["R"] < T * K
    experts_P, gates_P = routing.expert_ids.flatten(), routing.gates.flatten()
    p_P = inclusion_probabilities(env["scores_TK"].flatten(), experts_P, env["quotas_E"])
    kept = sel.pair_ids[:n_kept]
    assert len(set(kept.tolist())) == n_kept and (kept >= 0).all()
    # Dense reference, pair by pair: alpha_u / p_u * down[e]^T g_t.
    down_EDF, grad_out_TD = env["down_EDF"], env["grad_out_TD"]
    want_RF = torch.stack([gates_P[u] / p_P[u].float() * (down_EDF[experts_P[u]].t() @ grad_out_TD[u // K])
                           for u in kept.tolist()])
    torch.testing.assert_close(dphi_RF[:n_kept], want_RF, rtol=1e-4, atol=1e-5)
    assert torch.all(dphi_RF[n_kept:] == 0)


def test_memory_doc_plan_fits_its_budget(capsys):
    """docs/memory.md's planner example, run as written: its plan's layer fits the 6 GiB it was given."""
    code = next(c for c in DOC_BLOCKS["docs/memory.md"] if "plan_memory(cfg" in c and "MemoryConfig(" in c)
    env = {}
    exec(compile(code, "docs/memory.md", "exec"), env)
    assert capsys.readouterr().out.count("\n") == 5  # the five prints
    plan, cfg = env["plan"], env["cfg"]
    assert 0 < plan.retain <= 1 and plan.headroom >= 0
    mem = env["layer_memory"](cfg, retain=plan.retain, replicas=plan.replicas)
    assert mem.peak <= 6 * 2**30


def test_the_overview_maps_every_page_of_docs():
    """docs/overview.md's table links every page of docs/ (it once left out torchtitan.md, e2e.md and
    reliability.md)."""
    overview = (ROOT / "docs" / "overview.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", overview))
    pages = {path.name for path in (ROOT / "docs").glob("*.md")} - {"overview.md"}
    assert len(pages) >= 10 and not pages - linked, sorted(pages - linked)


def test_the_readme_layout_names_every_folder_and_example():
    """README's layout names every top-level folder, every folder of lrmoe/ and every script of examples/ that git
    tracks (it once left out examples/train_torchtitan.py)."""
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    paths = [Path(line) for line in tracked.splitlines()]
    names = {f"{p.parts[0]}/" for p in paths if len(p.parts) > 1 and not p.parts[0].startswith(".")}
    names |= {f"lrmoe/{p.parts[1]}/" for p in paths if p.parts[0] == "lrmoe" and len(p.parts) > 2}
    names |= {p.name for p in paths if p.parts[0] == "examples" and p.suffix == ".py"}
    assert {"examples/", "lrmoe/nn/", "train_ep.py"} <= names
    missing = sorted(name for name in names if not re.search(rf"(^|\s){re.escape(name)}", layout, flags=re.M))
    assert not missing, f"README's layout does not name {missing}"
