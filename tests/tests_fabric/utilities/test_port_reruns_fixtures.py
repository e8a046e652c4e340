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
"""A fixture that lost its port is set up again for the rerun, or there is no rerun: never a replay of its error."""

import pytest

from tests_fabric.helpers.inner_pytest import run_pytest

#: each fixture loses its port on its first setup, and pytest keeps its error for its scope: the next test shares it
_SHARED = """
    import pytest

    @pytest.fixture(scope="class")
    def class_store():
        if attempt("class_store") == 1:
            store_on_busy_port()

    class TestClassStore:
        def test_first(self, class_store):
            pass

        def test_last(self, class_store):
            pass

    @pytest.fixture(scope="module")
    def module_store():
        if attempt("module_store") == 1:
            store_on_busy_port()

    def test_first(module_store):
        pass

    def test_last(module_store):
        pass
"""


@pytest.mark.timeout(300)
def test_a_shared_fixture_is_rerun_only_by_its_last_test_and_set_up_again_for_it(tmp_path):
    """The first test fails as without the plugin; the last one's rerun follows the fixture's teardown."""
    without = run_pytest(tmp_path / "without", _SHARED, conftest="")
    assert "4 errors" in without.result.stdout, without.result.stdout[-3000:]
    run = run_pytest(tmp_path / "with", _SHARED)
    assert run.attempts() == {"class_store": 2, "module_store": 2}, run.result.stdout[-3000:]
    reruns = [(test.split("::", 1)[1], when) for test, when, outcome in run.outcomes() if outcome == "rerun"]
    assert sorted(reruns) == [("TestClassStore::test_last", "setup"), ("test_last", "setup")]
    assert "2 passed, 2 errors, 2 rerun" in run.result.stdout, run.result.stdout[-3000:]


#: the fixtures lose their port on their first setup, and pytest tears them down after it: no next test shares them
_TORN_DOWN = """
    import pytest

    @pytest.fixture(scope="class")
    def class_store():
        if attempt("class_store") == 1:
            store_on_busy_port()

    class TestAlone:
        def test_only(self, class_store):
            pass

    @pytest.fixture
    def function_store():
        if attempt("function_store") == 1:
            store_on_busy_port()

    def test_function_fixture(function_store):
        pass

    @pytest.fixture(scope="module")
    def module_store():
        if attempt("module_store") == 1:
            store_on_busy_port()

    def test_last(module_store):
        pass
"""


@pytest.mark.timeout(300)
def test_a_fixture_that_lost_its_port_is_set_up_again_for_the_rerun(tmp_path):
    run = run_pytest(tmp_path, _TORN_DOWN)
    assert run.attempts() == {"class_store": 2, "function_store": 2, "module_store": 2}, run.result.stdout[-3000:]
    assert "3 passed, 3 rerun" in run.result.stdout, run.result.stdout[-3000:]
    reruns = [(test.split("::", 1)[1], when) for test, when, outcome in run.outcomes() if outcome == "rerun"]
    assert sorted(reruns) == [
        ("TestAlone::test_only", "setup"),
        ("test_function_fixture", "setup"),
        ("test_last", "setup"),
    ]
