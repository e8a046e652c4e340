# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""What the port-conflict rerun plugin's reruns look like in JUnit XML, as CI dashboards read it: one test, one case."""

import re
import xml.etree.ElementTree as ET

import pytest
from lightning_utilities.core.imports import RequirementCache

from tests_fabric.helpers.inner_pytest import run_pytest

_LOSE_PORTS = """
    def test_loses_its_port_every_time():
        attempt("always")
        store_on_busy_port()

    def test_loses_its_port_once():
        if attempt("once") == 1:
            store_on_busy_port()

    def test_keeps_its_port(record_property):
        record_property("own", "kept")
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "args",
    [[], pytest.param(["-n", "2"], marks=pytest.mark.skipif(not RequirementCache("pytest-xdist"), reason="xdist"))],
    ids=["serial", "xdist"],
)
def test_junit_xml_has_one_test_case_per_test_with_its_last_outcome(tmp_path, args):
    xml = tmp_path / "junit.xml"
    run = run_pytest(tmp_path, _LOSE_PORTS, f"--junitxml={xml}", *args)
    assert run.attempts() == {"always": 3, "once": 2}, run.result.stdout[-3000:]
    # the terminal's count is pytest's (the warning: record_property in JUnit XML's default xunit2 family)
    assert re.search(r" 1 failed, 2 passed, (1 warning, )?3 rerun in ", run.result.stdout), run.result.stdout[-3000:]
    suite = ET.parse(xml).getroot().find("testsuite")  # noqa: S314 (the inner run's own report)
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "0")
    cases = {}
    for case in suite.iter("testcase"):
        cases.setdefault(case.get("name"), []).append(case)
    assert sorted(cases) == ["test_keeps_its_port", "test_loses_its_port_every_time", "test_loses_its_port_once"]
    assert all(len(found) == 1 for found in cases.values()), {name: len(found) for name, found in cases.items()}

    def outcome(name):
        return [child.tag for child in cases[name][0] if child.tag != "properties"]

    def properties(name):
        return {p.get("name"): p.get("value") for p in cases[name][0].iter("property")}

    assert outcome("test_loses_its_port_every_time") == ["failure"]
    # torch's own words for it: "EADDRINUSE" (2.2 and newer) or "Address already in use" (2.1)
    message = cases["test_loses_its_port_every_time"][0].find("failure").get("message")
    assert re.search("EADDRINUSE|address already in use", message, flags=re.IGNORECASE), message
    assert properties("test_loses_its_port_every_time") == {"port_conflict_reruns": "2"}
    assert outcome("test_loses_its_port_once") == []  # a pass
    assert properties("test_loses_its_port_once") == {"port_conflict_reruns": "1"}
    assert outcome("test_keeps_its_port") == []
    assert properties("test_keeps_its_port") == {"own": "kept"}
