"""capture/usersource.py: the user's files read and parsed once per snapshot, shared by construct.py and sites.py."""

import ast
import os

import torch
import torch.nn as nn

from nanreplay.capture import construct, sites, usersource

LOOP = "net = nn.Sequential(nn.Linear(2, 2), nn.Sigmoid())\nopt = torch.optim.SGD(net.parameters(), lr=0.1)\n"


def test_one_snapshot_parses_a_file_once_for_both_the_construction_and_the_optimizer_site(tmp_path, monkeypatch):
    f = tmp_path / "loop.py"
    f.write_text(LOOP)
    net = nn.Sequential(nn.Linear(2, 2), nn.Sigmoid())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    parsed = []
    real = ast.parse
    monkeypatch.setattr(usersource.ast, "parse", lambda src, *a, **k: parsed.append(src) or real(src, *a, **k))
    sources = usersource.Sources()
    built = construct.records(net, {"frames": [{"file": str(f)}]}, sources)
    made = sites.find([str(f)], opt, None, None, None, sources)
    assert [(r["module"], r["line"]) for r in built or []] == [("", 1)]
    assert [(s["what"], s["line"]) for s in made] == [("optimizer", 2)]
    assert len(parsed) == 1  # the second reader got the first one's tree


def test_a_file_that_is_too_large_or_not_python_is_not_read_and_library_files_are_not_the_users(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (usersource.MAX_FILE_BYTES // 6 + 1))
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    ok = tmp_path / "ok.py"
    ok.write_text(LOOP)
    sources = usersource.Sources()
    assert sources.parse(str(big)) is None and sources.parse(str(broken)) is None
    assert sources.parse(str(tmp_path / "missing.py")) is None
    assert sources.parse(str(ok))[0] == LOOP.splitlines(keepends=True)
    assert usersource.is_user(str(ok))
    assert not usersource.is_user(torch.nn.modules.linear.__file__)
    assert not usersource.is_user(usersource.__file__) and not usersource.is_user(os.__file__)
