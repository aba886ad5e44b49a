"""loraplex.env_switch: the on/off/variant settings read from the environment (LORAPLEX_LORA_OVERLAP,
LORAPLEX_HOST_PRIORITY, LORAPLEX_GRAPH_PRIORITY)."""
import pytest

from loraplex.env_switch import env_switch


@pytest.mark.parametrize("value, want", [(None, "fast"), ("", "fast"), ("1", "fast"), (" TRUE ", "fast"),
                                         ("yes", "fast"), ("on", "fast"), ("Fast", "fast"), ("0", "never"),
                                         ("false", "never"), ("No", "never"), ("off", "never"),
                                         ("never", "never"), ("sometimes", "sometimes")])
def test_values_and_aliases(value, want, monkeypatch):
    if value is None:
        monkeypatch.delenv("LORAPLEX_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_TEST_SWITCH", value)
    assert env_switch("LORAPLEX_TEST_SWITCH", "1", on="fast", off="never", others=("sometimes",)) == want


def test_the_default_when_unset_can_be_any_choice(monkeypatch):
    monkeypatch.delenv("LORAPLEX_TEST_SWITCH", raising=False)
    assert env_switch("LORAPLEX_TEST_SWITCH", "sometimes", on="fast", off="never", others=("sometimes",)) == \
        "sometimes"
    assert env_switch("LORAPLEX_TEST_SWITCH", "0", on="fast", off="never") == "never"


def test_a_bad_value_names_the_variable_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv("LORAPLEX_TEST_SWITCH", "sometime")
    with pytest.raises(ValueError) as err:
        env_switch("LORAPLEX_TEST_SWITCH", "1", on="fast", off="never", others=("sometimes", "often"))
    assert str(err.value) == ("LORAPLEX_TEST_SWITCH='sometime': expected fast (or 1), sometimes, often, "
                              "or never (or 0)")
    with pytest.raises(ValueError, match=r"expected fast \(or 1\), or never \(or 0\)"):
        env_switch("LORAPLEX_TEST_SWITCH", "1", on="fast", off="never")
