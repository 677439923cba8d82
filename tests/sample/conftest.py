"""The `specdec sample` tests' fixture: the command's family replaced by the tiny random one."""
import pytest

from decoding_models import TinyFamily
from specdec import cli


@pytest.fixture
def tiny(monkeypatch):
    fam = TinyFamily()
    monkeypatch.setattr(cli, "embedded_family", lambda args: fam)
    return fam
