"""The Prefect UI, driven in a real browser (Debian's chromium through Playwright): open the `manual` deployment,
Run -> Custom run, change train.steps in the parameter form, submit; the worker runs it with that value."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from support.requires import missing
from support.stack_support import (
    REPO,
    assert_completed,
    deployment,
    mlflow_runs_of_flow_run,
    prefect_api,
    runs_of,
    wait_for_run,
)

from infra.names import TAG_FLOW_RUN_ID, TAG_GIT_COMMIT, TAG_STAGE
from infra.tracking import STAGES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHROMIUM = "/usr/bin/chromium"
# Debian's build, headless; no Playwright browser download, no calls home.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = REPO / "tests" / "artifacts"
STEPS = 7


def form_property(scope, label: str):
    """The innermost schema-form property whose label starts with `label` (e.g. 'Train', 'Steps')."""
    title = scope.page.locator("span.schema-form-property__label", has_text=re.compile(rf"^{label}\b"))
    return scope.locator("div.schema-form-property").filter(has=title).last


def test_custom_run_from_the_ui_form_runs_with_the_edited_steps(stack):
    if shutil.which(CHROMIUM) is None:
        missing(f"no {CHROMIUM} (make test installs it)")
    from playwright.sync_api import sync_playwright

    api, ui = stack["api"], stack["status"]["prefect"]["ui"]
    manual = deployment(api, "shardline/manual")
    # The operator's defaults for this deployment: the debug model, so the run takes about a minute here.
    defaults = {"config": stack["config"]("stack-ui", steps=30)}
    prefect_api("PATCH", f"{api}/deployments/{manual['id']}", json={"parameters": defaults})
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{ui}/deployments/deployment/{manual['id']}")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run", exact=True).click()
            page.wait_for_url(re.compile(r"/deployments/deployment/.+/run"))

            train = form_property(page.locator("body"), "Train")
            steps = form_property(train, "Steps").locator("input[type=number]")
            assert steps.input_value() == "30"  # the form shows the deployment's parameters
            steps.fill(str(STEPS))
            before = {r["id"] for r in runs_of(api, manual["id"])}
            page.get_by_role("button", name="Submit").click()
            # The run the form created, as the API lists it. Its page may take long to come back on 2 cores busy
            # with the rest of the suite (once, 60 s were not enough): the run is what the test is about.
            deadline, new = time.monotonic() + 180, []
            while not new and time.monotonic() < deadline:
                page.wait_for_timeout(1000)
                new = [r["id"] for r in runs_of(api, manual["id"]) if r["id"] not in before]
            if not new:
                page.screenshot(path=str(ARTIFACTS / "prefect-ui-submit-stuck.png"), full_page=True)
                shown = page.locator("[role=alert]").all_inner_texts()
                raise AssertionError(f"no run was created by Submit in 180 s; the page shows: {shown}")
            assert len(new) == 1, new
            run_id = new[0]

            done = wait_for_run(api, run_id, 420, stack["log"])
            page.goto(f"{ui}/runs/flow-run/{run_id}")
            page.get_by_text("Completed").first.wait_for()
            page.screenshot(path=str(ARTIFACTS / "prefect-ui-custom-run.png"), full_page=True)
            browser.close()
    finally:
        prefect_api("PATCH", f"{api}/deployments/{manual['id']}", json={"parameters": {}})
    assert_completed(done, stack["log"])
    assert done["deployment_id"] == manual["id"]
    assert done["parameters"]["config"]["train"]["steps"] == STEPS
    assert done["parameters"]["config"]["registry"]["model_name"] == "stack-ui"
    # The run really trained that many steps: the training stage logged its last step.
    import mlflow

    client = mlflow.MlflowClient(stack["tracking_uri"], registry_uri=stack["tracking_uri"])
    experiments = [e.experiment_id for e in client.search_experiments()]
    train_run = client.search_runs(
        experiments,
        filter_string=f"tags.`shardline.prefect_flow_run_id` = '{run_id}' and tags.`shardline.stage` = 'train_fsdp'",
    )[0]
    assert train_run.data.params["train.steps"] == str(STEPS)

    # A manual run on the worker lands in the stack (this was a second, REST-created run of its own until a CI run
    # timed out; the UI's Custom run is the same flow run on the same worker): the MLflow server holds the run tree of
    # this flow run, the parent and one child per stage...
    runs = mlflow_runs_of_flow_run(stack["tracking_uri"], run_id)
    assert {r.data.tags.get(TAG_STAGE) for r in runs} == {"pipeline", *STAGES}
    parent = next(r for r in runs if r.data.tags[TAG_STAGE] == "pipeline")
    # ...the code that ran is the deployed commit, from the run's clone...
    assert parent.data.tags[TAG_GIT_COMMIT] == stack["status"]["prefect"]["deployed_commit"]
    # ...what it made is under the stack's $SHARDLINE_HOME, which outlives the run's temporary clone...
    home = stack["home"]
    assert any((home / "shards").rglob("manifest.json"))
    assert any((home / "checkpoints").iterdir())
    # ...and its version is the champion the stack's endpoint serves.
    champion = client.get_model_version_by_alias("stack-ui", "champion")
    assert champion.tags[TAG_FLOW_RUN_ID] == run_id
    endpoint = stack["status"].get("endpoint")
    if endpoint is not None:
        served = httpx.post(
            f"{endpoint['url']}/v1/score", json={"model": "stack-ui", "text": "def f(x):\n    return x\n"}, timeout=60
        )
        assert served.status_code == 200, served.text
        assert served.json()["model_version"] == champion.version
    assert Path(ARTIFACTS / "prefect-ui-custom-run.png").stat().st_size > 10_000
