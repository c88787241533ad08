"""A command's own key=value options (mpt.config_parse.parse_options): typed like their defaults, a
mistake is one line, -h lists the keys."""
import pytest

from mpt import config_parse
from mpt.errors import UserError


def test_parse_options_types_like_the_defaults(capsys):
    d = {"n": 3, "w": 0.5, "flag": False, "name": "auto"}
    assert config_parse.parse_options(["n=4", "w=1e-3", "flag=true", "name=224"], d, "x") == \
        {"n": 4, "w": 0.001, "flag": True, "name": "224"}
    for argv, msg in [(["m=1"], "unknown key 'm'; valid keys: n, w, flag, name"),
                      (["n=many"], "option 'n' expects an integer"), (["w=inf"], "finite"),
                      (["flag=maybe"], "option 'flag' expects true/false"), (["n"], "bad argument 'n'")]:
        with pytest.raises(UserError, match=msg.replace("(", r"\(")):
            config_parse.parse_options(argv, d, "x")
    with pytest.raises(SystemExit):
        config_parse.parse_options(["--help"], d, "prog")
    assert "n=3" in capsys.readouterr().out
