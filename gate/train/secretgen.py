"""Fake credentials of every format the secret rules claim, inside realistic carriers.

Each ``Format`` is a template with random fields (``{h:32}`` = 32 lowercase hex characters) plus
the variable name an operator would give it; ``credential(rng, fmt)`` fills it (computing the
CRC32 of GitHub/npm tokens and the JSON header of JWTs, so checksum validators see real
structure) and ``carry(rng, name, value, carrier)`` puts it where such values really sit: a
``.env`` file, YAML, ``~/.aws/credentials``, shell history, a compose file, a log line, JSON.

The format list follows the checklists of two popular scanners (gitleaks' default rules and
CredSweeper's config), deduplicated; every value is random, none is a live key. Benign look-alikes
(lockfile hashes, documentation example keys) are in ``lookalikes``: a scanner must not flag them.
"""

from __future__ import annotations

import base64
import json
import random
import re
import string
import zlib
from dataclasses import dataclass

_B62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
ALPHABETS = {
    "h": "0123456789abcdef", "H": "0123456789ABCDEF", "A": string.ascii_letters + string.digits,
    "l": string.ascii_lowercase + string.digits, "U": string.ascii_uppercase + string.digits,
    "a": string.ascii_letters, "D": string.digits, "W": string.ascii_letters + string.digits + "_-",
    "B": string.ascii_letters + string.digits + "+/", "Z": "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567",
    "C": "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", "P": string.ascii_letters + string.digits + "!#%*+-.^_~",
}
CARRIERS = ("env", "yaml", "aws_ini", "shell", "compose", "log", "json")


@dataclass(frozen=True)
class Format:
    id: str
    name: str  # the variable an operator stores it in
    template: str
    inline: bool = False  # the value carries its own context (URL, PEM block, header): no name needed


def _fill(rng: random.Random, template: str) -> str:
    return re.sub(r"\{([A-Za-z]):(\d+)\}", lambda m: "".join(rng.choice(ALPHABETS[m[1]]) for _ in range(int(m[2]))), template)


def _crc_token(prefix: str, rng: random.Random) -> str:
    body = "".join(rng.choice(_B62) for _ in range(30))
    n, digits = zlib.crc32(body.encode()), ""
    while n:
        n, d = divmod(n, 62)
        digits = _B62[d] + digits
    return f"{prefix}_{body}{digits.rjust(6, '0')}"


def _b64url(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).decode().rstrip("=")


def _jwt(rng: random.Random) -> str:
    head = _b64url({"alg": rng.choice(["HS256", "RS256", "ES256"]), "typ": "JWT"})
    body = _b64url({"sub": str(rng.randrange(10**6, 10**9)), "iat": rng.randrange(1_600_000_000, 1_800_000_000), "scope": "read write"})
    return f"{head}.{body}.{_fill(rng, '{W:43}')}"


# The DER prefix real keys of each label start with (SEQUENCE, version, algorithm): scanners that
# check a PEM body's structure (CredSweeper does) must see a key, not random bytes.
DER_PREFIX = {
    "RSA PRIVATE KEY": bytes.fromhex("308204a40201000282010100"), "PRIVATE KEY": bytes.fromhex("308204be020100300d06092a864886f70d0101010500"),
    "EC PRIVATE KEY": bytes.fromhex("307702010104"), "DSA PRIVATE KEY": bytes.fromhex("308201bb02010002818100"),
    "ENCRYPTED PRIVATE KEY": bytes.fromhex("3082050c304006092a864886f70d01050d"),
}


def _pem(rng: random.Random, label: str, n_bytes: int) -> str:
    head = DER_PREFIX.get(label, b"")
    raw = base64.b64encode(head + rng.randbytes(n_bytes - len(head))).decode()
    return f"-----BEGIN {label}-----\n" + "\n".join(raw[i : i + 64] for i in range(0, len(raw), 64)) + f"\n-----END {label}-----"


def _openssh(rng: random.Random) -> str:
    """An ed25519 key as ``ssh-keygen`` writes it: the fixed header bytes give long ``AAAA`` runs."""
    pub = rng.randbytes(32)
    blob = (b"openssh-key-v1\x00" + b"\x00\x00\x00\x04none" * 2 + b"\x00\x00\x00\x00\x00\x00\x00\x01"
            + b"\x00\x00\x00\x33\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + pub
            + b"\x00\x00\x00\x88" + rng.randbytes(8) + b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + pub
            + b"\x00\x00\x00\x40" + rng.randbytes(32) + pub + b"\x00\x00\x00\x0auser@host\x01\x02\x03")
    raw = base64.b64encode(blob).decode()
    return "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(raw[i : i + 70] for i in range(0, len(raw), 70)) + "\n-----END OPENSSH PRIVATE KEY-----"


def _password(rng: random.Random) -> str:
    """What people put in config files: random 10-20 chars with symbols, or words with digits."""
    if rng.random() < 0.5:
        return _fill(rng, "{P:%d}" % rng.randint(10, 20))
    words = ["Summer", "Falcon", "river", "Orange", "tiger", "Mango", "Winter", "rocket", "Purple", "castle"]
    return rng.choice(words) + rng.choice(words) + str(rng.randint(10, 9999)) + rng.choice("!@#$%&*?")


SPECIAL = {
    "github-pat": lambda r: _crc_token("ghp", r), "github-oauth": lambda r: _crc_token("gho", r),
    "github-app": lambda r: _crc_token(r.choice(["ghu", "ghs"]), r), "github-refresh": lambda r: _crc_token("ghr", r),
    "npm": lambda r: _crc_token("npm", r), "jwt": _jwt,
    "pem-rsa": lambda r: _pem(r, "RSA PRIVATE KEY", 1190), "pem-ec": lambda r: _pem(r, "EC PRIVATE KEY", 121),
    "pem-pkcs8": lambda r: _pem(r, "PRIVATE KEY", 1218), "pem-encrypted": lambda r: _pem(r, "ENCRYPTED PRIVATE KEY", 1298),
    "pem-dsa": lambda r: _pem(r, "DSA PRIVATE KEY", 440), "pgp-private": lambda r: _pem(r, "PGP PRIVATE KEY BLOCK", 900),
    "openssh": _openssh, "password": _password,
}

FORMATS: tuple[Format, ...] = (
    Format("aws-access-key-id", "AWS_ACCESS_KEY_ID", "AKIA{Z:16}"),
    Format("aws-secret-access-key", "AWS_SECRET_ACCESS_KEY", "{B:40}"),
    Format("aws-session-token", "AWS_SESSION_TOKEN", "IQoJb3JpZ2luX2Vj{B:300}"),
    Format("gcp-api-key", "GOOGLE_API_KEY", "AIza{W:35}"),
    Format("gcp-oauth-secret", "GOOGLE_CLIENT_SECRET", "GOCSPX-{W:28}"),
    Format("gcp-oauth-token", "GOOGLE_ACCESS_TOKEN", "ya29.{W:120}"),
    Format("azure-storage", "AZURE_STORAGE_CONNECTION_STRING", "DefaultEndpointsProtocol=https;AccountName={l:12};AccountKey={B:86}==;EndpointSuffix=core.windows.net", inline=True),
    Format("azure-ad-client-secret", "AZURE_CLIENT_SECRET", "{a:3}8Q~{W:34}"),
    Format("github-pat", "GITHUB_TOKEN", ""), Format("github-oauth", "GH_OAUTH_TOKEN", ""),
    Format("github-app", "GITHUB_APP_TOKEN", ""), Format("github-refresh", "GITHUB_REFRESH_TOKEN", ""),
    Format("github-fine-grained", "GH_TOKEN", "github_pat_{A:22}_{A:59}"),
    Format("gitlab-pat", "GITLAB_TOKEN", "glpat-{W:20}"),
    Format("gitlab-runner", "CI_RUNNER_TOKEN", "glrt-{W:20}"),
    Format("gitlab-deploy", "GITLAB_DEPLOY_TOKEN", "gldt-{W:20}"),
    Format("gitlab-trigger", "GITLAB_TRIGGER_TOKEN", "glptt-{h:40}"),
    Format("gitlab-runner-registration", "REGISTRATION_TOKEN", "GR1348941{W:20}"),
    Format("npm", "NPM_TOKEN", ""),
    Format("pypi", "TWINE_PASSWORD", "pypi-AgEIcHlwaS5vcmc{W:120}"),
    Format("rubygems", "GEM_HOST_API_KEY", "rubygems_{h:48}"),
    Format("nuget", "NUGET_API_KEY", "oy2{l:43}"),
    Format("clojars", "CLOJARS_TOKEN", "CLOJARS_{l:60}"),
    Format("slack-bot", "SLACK_BOT_TOKEN", "xoxb-{D:12}-{D:13}-{A:24}"),
    Format("slack-user", "SLACK_USER_TOKEN", "xoxp-{D:12}-{D:12}-{D:13}-{h:32}"),
    Format("slack-app", "SLACK_APP_TOKEN", "xapp-1-{U:11}-{D:13}-{h:64}"),
    Format("slack-webhook", "SLACK_WEBHOOK_URL", "https://hooks.slack.com/services/T{U:10}/B{U:10}/{A:24}", inline=True),
    Format("discord-bot", "DISCORD_TOKEN", "MT{A:24}.{W:6}.{W:38}"),
    Format("discord-webhook", "DISCORD_WEBHOOK", "https://discord.com/api/webhooks/{D:18}/{W:68}", inline=True),
    Format("teams-webhook", "TEAMS_WEBHOOK_URL", "https://acme.webhook.office.com/webhookb2/{h:8}-{h:4}-{h:4}-{h:4}-{h:12}@{h:8}-{h:4}-{h:4}-{h:4}-{h:12}/IncomingWebhook/{h:32}/{h:8}-{h:4}-{h:4}-{h:4}-{h:12}", inline=True),
    Format("stripe-secret", "STRIPE_SECRET_KEY", "sk_live_{A:99}"),
    Format("stripe-restricted", "STRIPE_RESTRICTED_KEY", "rk_live_{A:24}"),
    Format("stripe-webhook", "STRIPE_WEBHOOK_SECRET", "whsec_{A:32}"),
    Format("twilio-api-key", "TWILIO_API_KEY", "SK{h:32}"),
    Format("twilio-auth-token", "TWILIO_AUTH_TOKEN", "{h:32}"),
    Format("sendgrid", "SENDGRID_API_KEY", "SG.{W:22}.{W:43}"),
    Format("sendinblue", "BREVO_API_KEY", "xkeysib-{h:64}-{A:16}"),
    Format("mailchimp", "MAILCHIMP_API_KEY", "{h:32}-us{D:2}"),
    Format("mailgun", "MAILGUN_API_KEY", "key-{h:32}"),
    Format("openai", "OPENAI_API_KEY", "sk-proj-{W:74}T3BlbkFJ{W:74}"),
    Format("openai-legacy", "OPENAI_API_KEY", "sk-{A:20}T3BlbkFJ{A:20}"),
    Format("anthropic", "ANTHROPIC_API_KEY", "sk-ant-api03-{W:93}AA"),
    Format("huggingface", "HF_TOKEN", "hf_{a:34}"),
    Format("huggingface-org", "HF_ORG_TOKEN", "api_org_{a:34}"),
    Format("groq", "GROQ_API_KEY", "gsk_{A:20}WGdyb3FY{A:24}"),
    Format("xai", "XAI_API_KEY", "xai-{A:80}"),
    Format("openrouter", "OPENROUTER_API_KEY", "sk-or-v1-{h:64}"),
    Format("perplexity", "PERPLEXITY_API_KEY", "pplx-{A:48}"),
    Format("cohere", "CO_API_KEY", "{A:40}"),
    Format("telegram", "TELEGRAM_BOT_TOKEN", "{D:10}:AA{W:33}"),
    Format("jwt", "ACCESS_TOKEN", ""),
    Format("pem-rsa", "", "", inline=True), Format("pem-ec", "", "", inline=True),
    Format("pem-pkcs8", "", "", inline=True), Format("pem-encrypted", "", "", inline=True),
    Format("pem-dsa", "", "", inline=True), Format("pgp-private", "", "", inline=True),
    Format("openssh", "", "", inline=True),
    Format("putty", "", "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nComment: deploy\nPublic-Lines: 2\nAAAAC3NzaC1lZDI1NTE5AAAAI{B:43}\nPrivate-Lines: 1\nAAAAI{B:43}\nPrivate-MAC: {h:64}", inline=True),
    Format("age", "SOPS_AGE_KEY", "AGE-SECRET-KEY-1{C:58}"),
    Format("digitalocean-pat", "DIGITALOCEAN_TOKEN", "dop_v1_{h:64}"),
    Format("digitalocean-oauth", "DO_OAUTH_TOKEN", "doo_v1_{h:64}"),
    Format("digitalocean-refresh", "DO_REFRESH_TOKEN", "dor_v1_{h:64}"),
    Format("shopify-access", "SHOPIFY_ACCESS_TOKEN", "shpat_{h:32}"),
    Format("shopify-custom", "SHOPIFY_TOKEN", "shpca_{h:32}"),
    Format("shopify-private-app", "SHOPIFY_PASSWORD", "shppa_{h:32}"),
    Format("shopify-shared-secret", "SHOPIFY_SHARED_SECRET", "shpss_{h:32}"),
    Format("url-postgres", "DATABASE_URL", "postgresql://app_user:{P:16}@db-{l:6}.internal:5432/orders", inline=True),
    Format("url-mysql", "DB_URL", "mysql://root:{A:14}@10.0.{D:1}.{D:2}:3306/shop", inline=True),
    Format("url-mongodb", "MONGO_URI", "mongodb+srv://svc:{A:20}@cluster0.{l:5}.mongodb.net/prod?retryWrites=true", inline=True),
    Format("url-redis", "REDIS_URL", "redis://default:{A:32}@cache.{l:6}.io:6379/0", inline=True),
    Format("url-amqp", "AMQP_URL", "amqps://worker:{A:18}@mq.{l:6}.net/vhost", inline=True),
    Format("jdbc-password", "SPRING_DATASOURCE_URL", "jdbc:postgresql://db:5432/app?user=app&password={A:14}", inline=True),
    Format("ado-connection-string", "ConnectionStrings__Default", "Server=tcp:sql-{l:5}.database.windows.net,1433;Database=crm;User ID=crm_app;Password={P:14};Encrypt=True", inline=True),
    Format("basic-auth", "", "Authorization: Basic {basic}", inline=True),
    Format("bearer", "", "Authorization: Bearer {A:40}", inline=True),
    Format("db-password", "DB_PASSWORD", ""), Format("password", "password", ""),
    Format("mysql-root-password", "MYSQL_ROOT_PASSWORD", ""), Format("smtp-password", "SMTP_PASS", ""),
    Format("generic-api-key", "api_key", "{A:32}"), Format("generic-secret", "APP_SECRET", "{W:40}"),
    Format("generic-token", "AUTH_TOKEN", "{h:40}"), Format("generic-client-secret", "client_secret", "{W:32}"),
    Format("1password-service", "OP_SERVICE_ACCOUNT_TOKEN", "ops_eyJ{B:260}"),
    Format("1password-secret-key", "OP_SECRET_KEY", "A3-{U:6}-{U:11}-{U:5}-{U:5}-{U:5}"),
    Format("adobe-client-secret", "ADOBE_CLIENT_SECRET", "p8e-{A:32}"),
    Format("alibaba-access-key", "ALIBABA_CLOUD_ACCESS_KEY_ID", "LTAI{A:20}"),
    Format("artifactory", "ARTIFACTORY_API_KEY", "AKCp{A:69}"),
    Format("atlassian", "JIRA_API_TOKEN", "ATATT3xFfGF0{W:170}={H:8}"),
    Format("bitbucket-app-password", "BITBUCKET_APP_PASSWORD", "ATBB{A:24}{H:8}"),
    Format("circleci", "CIRCLECI_TOKEN", "CCIPAT_{A:22}_{h:40}"),
    Format("clickhouse", "CLICKHOUSE_SECRET", "4b1d{A:38}"),
    Format("cloudflare-api-token", "CLOUDFLARE_API_TOKEN", "{W:40}"),
    Format("cloudflare-origin-ca", "CF_ORIGIN_CA_KEY", "v1.0-{h:24}-{h:146}"),
    Format("databricks", "DATABRICKS_TOKEN", "dapi{h:32}"),
    Format("datadog", "DD_API_KEY", "{h:32}"),
    Format("doppler", "DOPPLER_TOKEN", "dp.pt.{A:43}"),
    Format("docker-pat", "DOCKER_PAT", "dckr_pat_{W:27}"),
    Format("duffel", "DUFFEL_TOKEN", "duffel_live_{W:43}"),
    Format("dynatrace", "DT_API_TOKEN", "dt0c01.{U:24}.{U:64}"),
    Format("easypost", "EASYPOST_API_KEY", "EZAK{A:54}"),
    Format("facebook-page", "FB_PAGE_TOKEN", "EAAC{A:140}"),
    Format("figma", "FIGMA_TOKEN", "figd_{W:40}"),
    Format("flutterwave", "FLW_SECRET_KEY", "FLWSECK_TEST-{h:32}-X"),
    Format("flyio", "FLY_API_TOKEN", "fo1_{W:43}"),
    Format("frameio", "FRAMEIO_TOKEN", "fio-u-{W:64}"),
    Format("grafana-cloud", "GRAFANA_CLOUD_TOKEN", "glc_{B:80}"),
    Format("grafana-service-account", "GRAFANA_SA_TOKEN", "glsa_{A:32}_{h:8}"),
    Format("harness", "HARNESS_API_KEY", "pat.{W:22}.{A:24}.{A:20}"),
    Format("terraform-cloud", "TFE_TOKEN", "{l:14}.atlasv1.{W:67}"),
    Format("heroku", "HEROKU_API_KEY", "HRKU-AA{W:58}"),
    Format("infracost", "INFRACOST_API_KEY", "ico-{A:32}"),
    Format("intra42", "INTRA_SECRET", "s-s4t2ud-{h:64}"),
    Format("linear", "LINEAR_API_KEY", "lin_api_{A:40}"),
    Format("mapbox-secret", "MAPBOX_SECRET_TOKEN", "sk.eyJ1Ijoi{A:20}.{W:22}"),
    Format("maxmind", "MAXMIND_LICENSE_KEY", "{A:6}_{A:29}_mmk"),
    Format("newrelic-user", "NEW_RELIC_API_KEY", "NRAK-{U:27}"),
    Format("newrelic-insert", "NEW_RELIC_INSERT_KEY", "NRII-{W:32}"),
    Format("notion", "NOTION_TOKEN", "ntn_{D:11}{A:35}"),
    Format("octopus", "OCTOPUS_API_KEY", "API-{U:26}"),
    Format("okta", "OKTA_API_TOKEN", "00{W:40}"),
    Format("openshift", "OPENSHIFT_TOKEN", "sha256~{W:43}"),
    Format("planetscale", "PLANETSCALE_TOKEN", "pscale_tkn_{W:43}"),
    Format("planetscale-password", "PLANETSCALE_PASSWORD", "pscale_pw_{W:43}"),
    Format("postman", "POSTMAN_API_KEY", "PMAK-{h:24}-{h:34}"),
    Format("prefect", "PREFECT_API_KEY", "pnu_{A:36}"),
    Format("pulumi", "PULUMI_ACCESS_TOKEN", "pul-{h:40}"),
    Format("readme", "README_API_KEY", "rdme_{l:70}"),
    Format("scalingo", "SCALINGO_API_TOKEN", "tk-us-{W:48}"),
    Format("sentry-user", "SENTRY_AUTH_TOKEN", "sntryu_{h:64}"),
    Format("sentry-org", "SENTRY_ORG_TOKEN", "sntrys_eyJpYXQiO{B:60}LCJyZWdpb25fdXJs{B:40}_{B:43}"),
    Format("settlemint", "SETTLEMINT_TOKEN", "sm_pat_{A:16}"),
    Format("shippo", "SHIPPO_API_KEY", "shippo_live_{h:40}"),
    Format("sonar", "SONAR_TOKEN", "squ_{h:40}"),
    Format("sourcegraph", "SRC_ACCESS_TOKEN", "sgp_{h:16}_{h:40}"),
    Format("square-access", "SQUARE_ACCESS_TOKEN", "EAAA{W:60}"),
    Format("square-oauth-secret", "SQUARE_OAUTH_SECRET", "sq0csp-{W:43}"),
    Format("supabase", "SUPABASE_ACCESS_TOKEN", "sbp_{h:40}"),
    Format("tailscale", "TS_AUTHKEY", "tskey-auth-{A:16}-{A:32}"),
    Format("together", "TOGETHER_API_KEY", "tgp_v1_{W:43}"),
    Format("typeform", "TYPEFORM_TOKEN", "tfp_{W:59}"),
    Format("vault-service", "VAULT_TOKEN", "hvs.{W:95}"),
    Format("vault-batch", "VAULT_BATCH_TOKEN", "hvb.{W:150}"),
    Format("vercel", "VERCEL_TOKEN", "vcp_{A:56}"),
    Format("netlify", "NETLIFY_AUTH_TOKEN", "nfp_{A:36}"),
    Format("posthog", "POSTHOG_PERSONAL_API_KEY", "phx_{A:43}"),
    Format("yandex-api", "YANDEX_API_KEY", "AQVN{W:36}"),
    Format("nkey-seed", "NATS_NKEY_SEED", "SU{Z:56}"),
    Format("twitter-bearer", "TWITTER_BEARER_TOKEN", "AAAAAAAAAAAAAAAAAAAAA{A:20}%3D{A:50}"),
    Format("kubernetes-sa-token", "KUBE_TOKEN", ""),
)
assert len({f.id for f in FORMATS}) == len(FORMATS)
SPECIAL["kubernetes-sa-token"] = _jwt
for _fid in ("db-password", "password", "mysql-root-password", "smtp-password"):
    SPECIAL[_fid] = _password


def credential(rng: random.Random, fmt: Format) -> str:
    if fmt.id in SPECIAL:
        return SPECIAL[fmt.id](rng)
    value = _fill(rng, fmt.template)
    if "{basic}" in value:
        value = value.replace("{basic}", base64.b64encode(f"deploy:{_password(rng)}".encode()).decode())
    return value


def carry(rng: random.Random, fmt: Format, value: str, carrier: str) -> str:
    """``value`` where an operator's tool output would show it."""
    host = f"ip-10-0-{rng.randint(0, 255)}-{rng.randint(0, 255)}"
    if fmt.inline:
        return _inline(rng, value, carrier, host)
    name = fmt.name
    return {
        "env": f"# service config\nNODE_ENV=production\nPORT={rng.randint(3000, 9000)}\n{name}={value}\nLOG_LEVEL=info\n",
        "yaml": f"service:\n  name: billing\n  replicas: 3\n  credentials:\n    {name.lower()}: \"{value}\"\n  region: eu-west-1\n",
        "aws_ini": f"[default]\nregion = us-east-1\n\n[profile ci]\n{name.lower()} = {value}\noutput = json\n",
        "shell": f"  501  cd ~/deploy\n  502  export {name}={value}\n  503  ./run.sh --env prod\n  504  git status\n",
        "compose": f"services:\n  api:\n    image: acme/api:1.4\n    environment:\n      - {name}={value}\n      - TZ=UTC\n    ports:\n      - \"8080:8080\"\n",
        "log": f"2025-03-0{rng.randint(1, 9)}T10:12:44Z {host} app[812]: INFO loaded settings {name}={value} from environment\n2025-03-01T10:12:45Z {host} app[812]: INFO listening on :8080\n",
        "json": json.dumps({"id": rng.randint(1, 10**6), "config": {name: value, "enabled": True}, "owner": "team-billing"}, indent=2),
    }[carrier]


def _inline(rng: random.Random, value: str, carrier: str, host: str) -> str:
    if value.startswith(("-----BEGIN", "PuTTY")):
        return {
            "env": f"$ cat ~/.ssh/id_deploy\n{value}\n$ ",
            "yaml": "tls:\n  key: |\n" + "\n".join("    " + line for line in value.splitlines()) + "\n",
            "aws_ini": f"# exported by vault read\n{value}\n",
            "shell": f"user@{host}:~$ cat ~/.ssh/id_ed25519\n{value}\nuser@{host}:~$ ls\n",
            "compose": "secrets:\n  deploy_key:\n    content: |\n" + "\n".join("      " + line for line in value.splitlines()) + "\n",
            "log": f"2025-03-01T10:12:44Z {host} sshd: DEBUG loaded key material\n{value}\n",
            "json": json.dumps({"type": "service_account", "project_id": "acme-prod", "private_key": value + "\n"}, indent=2),
        }[carrier]
    return {
        "env": f"APP_ENV=production\n{value if value.startswith('Authorization') else 'URL=' + value}\n",
        "yaml": f"backend:\n  endpoint: \"{value}\"\n  timeout: 30\n",
        "aws_ini": f"[connections]\nprimary = {value}\n",
        "shell": f"  310  curl -s -H \"{value}\" https://api.internal/v1/health\n" if value.startswith("Authorization") else f"  310  psql \"{value}\"\n",
        "compose": f"services:\n  worker:\n    environment:\n      - TARGET={value}\n",
        "log": f"2025-03-01T10:12:44Z {host} worker[77]: WARN retrying request with {value}\n",
        "json": json.dumps({"request": {"headers": {"Authorization": value.split(": ", 1)[1]}} if value.startswith("Authorization") else {"url": value}}),
    }[carrier]


def corpus(seed: int = 15, per_format: int = 7) -> list[dict]:
    """``per_format`` documents per format, cycling through the carriers: {"format", "carrier", "text", "secret"}."""
    rng = random.Random(seed)
    rows = []
    for fmt in FORMATS:
        for i in range(per_format):
            carrier = CARRIERS[i % len(CARRIERS)]
            value = credential(rng, fmt)
            rows.append({"format": fmt.id, "carrier": carrier, "text": carry(rng, fmt, value, carrier), "secret": value})
    return rows


DOC_EXAMPLES = (
    "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "sk_test_4eC39HqLyjWDarjtT1zdp7dc",
    "sk_test_BQokikJOvBiI2HlWgH4olfQ2", "pk_test_TYooMQauvdEDq54NiTphI7jx",
    "xoxb-17653672481-19874698323-pdFZKVeTuE8sk7oOcBrzbqgy", "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
    "SG.xxxxxxxxxxxxxxxxxxxxxx.yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy", "hf_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "AGE-SECRET-KEY-1QQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQ",
    "postgresql://user:password@localhost:5432/mydb", "mongodb://username:<password>@host:27017",
    "dop_v1_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
)


def lookalikes(seed: int = 16, n: int = 300) -> list[str]:
    """Benign documents that look like credentials: lockfile hashes, checksums, UUIDs, docs keys."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pkg, ver = rng.choice(["requests", "numpy", "left-pad", "lodash", "serde", "torch"]), f"{rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}"
        out.append([
            f'[[package]]\nname = "{pkg}"\nversion = "{ver}"\nfiles = [\n  {{file = "{pkg}-{ver}.tar.gz", hash = "sha256:{_fill(rng, "{h:64}")}"}},\n]\n',
            f'"node_modules/{pkg}": {{\n  "version": "{ver}",\n  "resolved": "https://registry.npmjs.org/{pkg}/-/{pkg}-{ver}.tgz",\n  "integrity": "sha512-{_fill(rng, "{B:86}")}=="\n}}',
            f"{pkg}=={ver} --hash=sha256:{_fill(rng, '{h:64}')}\n",
            f"commit {_fill(rng, '{h:40}')}\nAuthor: Dev <dev@example.org>\n\n    fix: bump {pkg} to {ver}\n",
            f"request_id={_fill(rng, '{h:8}-{h:4}-{h:4}-{h:4}-{h:12}')} trace={_fill(rng, '{h:32}')} status=200 latency_ms={rng.randint(1, 900)}",
            f"To authenticate, set the key in your environment, for example:\n\n    export OPENAI_API_KEY=\"sk-...\"\n    AWS key: {DOC_EXAMPLES[0]}\n    Stripe test key: {DOC_EXAMPLES[2]}\n",
            f"Example token from the docs: {rng.choice(DOC_EXAMPLES)}\n",
            f"password: ${{DB_PASSWORD}}\napi_key: {{{{ secrets.API_KEY }}}}\ntoken: <your-token-here>\nsecret_key = os.environ[\"SECRET_KEY\"]\n",
            f"digest: sha256:{_fill(rng, '{h:64}')}\nsize: {rng.randint(1000, 10**8)}\nmediaType: application/vnd.oci.image.layer.v1.tar+gzip\n",
            f"-----BEGIN PUBLIC KEY-----\n{_fill(rng, '{B:64}')}\n{_fill(rng, '{B:64}')}\n-----END PUBLIC KEY-----\n",
            f"-----BEGIN CERTIFICATE-----\n{_fill(rng, '{B:64}')}\n{_fill(rng, '{B:64}')}\n-----END CERTIFICATE-----\n",
            f"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{_fill(rng, '{B:43}')} dev@laptop\n",
        ][i % 12])
    return out
