import xml.etree.ElementTree as ET

from lmpress.evals.junit import write_junit

GATES = [
    {
        "gate": "ppl_ratio <= 1.05",
        "metric": "ppl_ratio",
        "op": "<=",
        "threshold": 1.05,
        "value": 1.02,
        "passed": True,
        "margin": 0.03,
    },
    {
        "gate": "kld_mean <= 0.02",
        "metric": "kld_mean",
        "op": "<=",
        "threshold": 0.02,
        "value": 0.0731,
        "passed": False,
        "margin": 0.02 - 0.0731,
    },
    {
        "gate": "top1_agreement >= 0.95",
        "metric": "top1_agreement",
        "op": ">=",
        "threshold": 0.95,
        "value": None,
        "passed": False,
        "margin": None,
    },
]


def test_one_testcase_per_gate_with_readable_failures(tmp_path):
    path = tmp_path / "ci" / "gates.xml"
    write_junit(GATES, path)
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert suite.get("tests") == "3" and suite.get("failures") == "2" and root.get("failures") == "2"
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [g["gate"] for g in GATES]
    assert cases[0].find("failure") is None
    message = cases[1].find("failure").get("message")
    assert message == "kld_mean = 0.0731, required <= 0.02, off by 0.0531"
    assert "not reported" in cases[2].find("failure").get("message")
    assert not list(path.parent.glob(".*.tmp"))


def test_all_passing(tmp_path):
    write_junit(GATES[:1], tmp_path / "ok.xml")
    root = ET.parse(tmp_path / "ok.xml").getroot()
    assert root.get("failures") == "0" and root.find("testsuite/testcase/failure") is None
