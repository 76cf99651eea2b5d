"""Are there cloud credentials for `ray up`? Checked on this machine, before anything is started or contacted."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Variable sets azure-identity's EnvironmentCredential / WorkloadIdentityCredential / ManagedIdentityCredential
# accept; any one complete set is enough to try.
_AZURE_ENV_SETS = (
    ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET"),
    ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_CERTIFICATE_PATH"),
    ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_FEDERATED_TOKEN_FILE"),
    ("IDENTITY_ENDPOINT",),
    ("MSI_ENDPOINT",),
)


def aws_credentials_missing() -> str:
    """'' when boto3's credential chain finds credentials (env, profile, SSO, instance role), else why not."""
    import boto3
    import botocore.exceptions

    try:
        found = boto3.Session().get_credentials()
    except botocore.exceptions.BotoCoreError as e:  # a broken profile, an expired SSO session
        return f"AWS credentials unusable: {str(e).splitlines()[0]}"
    if found is None:
        return (
            "no AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or run "
            "`aws configure` / `aws sso login`"
        )
    return ""


def _azure_cli_logged_in() -> bool:
    """The Azure CLI has an account (its profile lists a subscription); its tokens live beside it."""
    config_dir = Path(os.environ.get("AZURE_CONFIG_DIR") or Path.home() / ".azure")
    try:
        profile = json.loads((config_dir / "azureProfile.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return False
    return bool(profile.get("subscriptions"))


def azure_credentials_missing() -> str:
    """'' when Azure credentials are configured (service principal or workload/managed identity variables, or an
    Azure CLI login), else why not."""
    if any(all(os.environ.get(v) for v in names) for names in _AZURE_ENV_SETS) or _azure_cli_logged_in():
        return ""
    return (
        "no Azure credentials: run `az login`, or set AZURE_TENANT_ID, AZURE_CLIENT_ID and "
        "AZURE_CLIENT_SECRET (or a federated token / managed identity)"
    )


def credentials_missing(provider: str) -> str:
    """'' when `provider` ('aws', 'azure') has credentials on this machine, else a one-line reason."""
    return aws_credentials_missing() if provider == "aws" else azure_credentials_missing()
