//! `consume --lambda-handler MODULE.FUNCTION`: an unmodified Lambda handler as the handler. A
//! small runner, shipped inside this binary (`cli/runners/`), imports the handler as Lambda's
//! runtime would and speaks `--exec-format lambda` as each of the pool's children. Its code
//! reaches the interpreter through the environment (`python3 -c`, `node -e`): nothing is written
//! to disk, so an installed binary needs no files beside it and leaves none behind.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// The Python runner.
const PYTHON_RUNNER: &str = include_str!("../../runners/lambda_runner.py");
/// The Node.js runner.
const NODE_RUNNER: &str = include_str!("../../runners/lambda_runner.js");

/// Lambda's longest function timeout: a handler's remaining time without `--handler-timeout`.
pub(crate) const LAMBDA_MAX_TIMEOUT: Duration = Duration::from_secs(900);

/// How long loading the handler at start may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);

/// The language of a handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Runtime {
    /// `python3` on the PATH.
    Python,
    /// `node` on the PATH.
    Node,
}

/// `--lambda-runtime`: `python` or `node`, or a Lambda runtime identifier (`python3.12`,
/// `nodejs20.x`), which names the language: the interpreter is the one on the PATH.
pub(crate) fn parse_runtime(s: &str) -> Result<Runtime, String> {
    match s {
        "python" | "python3" => Ok(Runtime::Python),
        "node" | "nodejs" => Ok(Runtime::Node),
        _ if s.starts_with("python3.") => Ok(Runtime::Python),
        _ if s.starts_with("nodejs") && s.ends_with(".x") => Ok(Runtime::Node),
        other => Err(format!(
            "`{other}`: expected python or node (or a Lambda runtime such as python3.12, nodejs20.x)"
        )),
    }
}

impl Runtime {
    fn code(self) -> &'static str {
        match self {
            Runtime::Python => PYTHON_RUNNER,
            Runtime::Node => NODE_RUNNER,
        }
    }

    /// A child's command line (run by `sh -c`): the interpreter, running the runner's code from
    /// `SHARDWISE_RUNNER_CODE`, which the runner takes out of the handler's environment.
    fn command(self) -> &'static str {
        match self {
            Runtime::Python => {
                r#"exec python3 -u -c 'import os; exec(compile(os.environ.pop("SHARDWISE_RUNNER_CODE"), "shardwise-lambda-runner.py", "exec"))'"#
            }
            // Code run by `vm` has no `import()` of its own: the launcher lends it its own.
            Runtime::Node => {
                r#"exec node -e 'globalThis.shardwiseImport = (url) => import(url); const code = process.env.SHARDWISE_RUNNER_CODE; delete process.env.SHARDWISE_RUNNER_CODE; require("vm").runInThisContext(code, { filename: "shardwise-lambda-runner.js" })'"#
            }
        }
    }

    /// The runtime of the module `handler` names in `dir`, from the files there: `MODULE.py` (or
    /// a package) for Python, `MODULE.js`, `.mjs` or `.cjs` for Node.js.
    pub(crate) fn infer(handler: &str, dir: &Path) -> Result<Runtime, String> {
        let python = handler
            .rsplit_once('.')
            .map(|(module, _)| module.replace('.', "/"))
            .is_some_and(|module| {
                dir.join(format!("{module}.py")).is_file()
                    || dir.join(&module).join("__init__.py").is_file()
            });
        let (path, base) = handler.rsplit_once('/').unwrap_or(("", handler));
        let node = base.split_once('.').is_some_and(|(module, _)| {
            ["js", "mjs", "cjs"]
                .iter()
                .any(|ext| dir.join(path).join(format!("{module}.{ext}")).is_file())
        });
        match (python, node) {
            (true, false) => Ok(Runtime::Python),
            (false, true) => Ok(Runtime::Node),
            (true, true) => Err(format!(
                "both a Python and a Node.js module of --lambda-handler {handler} are in {}: say which with --lambda-runtime python|node",
                dir.display()
            )),
            (false, false) => Err(format!(
                "no module of --lambda-handler {handler} in {} (MODULE.py, or MODULE.js, .mjs or .cjs; --lambda-dir names the directory)",
                dir.display()
            )),
        }
    }
}

/// What the runner needs to run a handler.
#[derive(Debug, Clone)]
pub(crate) struct Runner {
    pub(crate) runtime: Runtime,
    /// `MODULE.FUNCTION`, as Lambda's `Handler` setting names it.
    pub(crate) handler: String,
    /// The context's function name.
    pub(crate) function_name: String,
    /// The context's function ARN.
    pub(crate) function_arn: String,
    /// What the context's remaining time counts down from.
    pub(crate) timeout: Duration,
}

impl Runner {
    /// The command line of each child.
    pub(crate) fn command(&self) -> String {
        self.runtime.command().to_string()
    }

    /// The children's environment: the runner's code and settings (and, for Python, no
    /// `__pycache__` written into the function's directory, which Lambda keeps read-only).
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let python =
            (self.runtime == Runtime::Python).then(|| ("PYTHONDONTWRITEBYTECODE", "1".to_string()));
        [
            ("SHARDWISE_RUNNER_CODE", self.runtime.code().to_string()),
            ("SHARDWISE_RUNNER_HANDLER", self.handler.clone()),
            ("SHARDWISE_RUNNER_FUNCTION_NAME", self.function_name.clone()),
            ("SHARDWISE_RUNNER_FUNCTION_ARN", self.function_arn.clone()),
            (
                "SHARDWISE_RUNNER_TIMEOUT_MS",
                self.timeout.as_millis().to_string(),
            ),
        ]
        .into_iter()
        .chain(python)
        .map(|(name, value)| (name.to_string(), value))
        .collect()
    }

    /// Loads the handler once in `dir`, before anything is consumed: a handler that cannot load
    /// (a missing module or function, a syntax error, no interpreter) stops `consume` at start
    /// with the interpreter's reason, instead of failing every batch. The module's top-level code
    /// runs (again in each child, as at each of Lambda's cold starts).
    ///
    /// Cancellation safe: the check's process is killed when dropped.
    pub(crate) async fn check(&self, dir: &Path) -> Result<(), String> {
        let run = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(self.command())
            .envs(self.env())
            .env("SHARDWISE_RUNNER_CHECK", "1")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(CHECK_TIMEOUT, run)
            .await
            .map_err(|_| format!("loading it took longer than {CHECK_TIMEOUT:?}"))?
            .map_err(|e| format!("cannot run sh: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        Err(format!(
            "{} ({})",
            lines[lines.len().saturating_sub(12)..].join("\n"),
            out.status
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_are_named_as_lambda_names_them() {
        for (name, runtime) in [
            ("python", Runtime::Python),
            ("python3.12", Runtime::Python),
            ("node", Runtime::Node),
            ("nodejs20.x", Runtime::Node),
        ] {
            assert_eq!(parse_runtime(name), Ok(runtime), "{name}");
        }
        for bad in ["java21", "ruby3.3", "nodejs20", "py"] {
            assert!(parse_runtime(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_runtime_follows_the_handlers_module() {
        let dir = std::env::temp_dir().join(format!("shardwise-runtime-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("pkg/sub")).unwrap();
        std::fs::create_dir_all(dir.join("src")).unwrap();
        for file in [
            "app.py",
            "pkg/sub/__init__.py",
            "index.mjs",
            "src/app.cjs",
            "both.py",
            "both.js",
        ] {
            std::fs::write(dir.join(file), "").unwrap();
        }
        let cases = [
            ("app.handler", Ok(Runtime::Python)),
            ("pkg.sub.handler", Ok(Runtime::Python)),
            ("index.handler", Ok(Runtime::Node)),
            ("src/app.handler", Ok(Runtime::Node)),
            ("both.handler", Err("both")),
            ("missing.handler", Err("no module")),
        ];
        for (handler, expected) in cases {
            match (Runtime::infer(handler, &dir), expected) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{handler}"),
                (Err(why), Err(want)) => assert!(why.contains(want), "{handler}: {why}"),
                (got, want) => panic!("{handler}: {got:?}, expected {want:?}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_handler_that_cannot_load_is_refused_with_the_interpreters_reason() {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lambda");
        let runner = |runtime, handler: &str| Runner {
            runtime,
            handler: handler.into(),
            function_name: "f".into(),
            function_arn: "arn:aws:lambda:us-east-1:000000000000:function:f".into(),
            timeout: Duration::from_secs(3),
        };
        runner(Runtime::Python, "lambda_function.lambda_handler")
            .check(&examples)
            .await
            .expect("AWS's sample loads");
        runner(Runtime::Node, "index.handler")
            .check(&examples)
            .await
            .expect("AWS's Node.js sample loads");
        let missing = runner(Runtime::Python, "lambda_function.nope")
            .check(&examples)
            .await
            .unwrap_err();
        assert!(
            missing.contains("Handler 'nope' missing on module 'lambda_function'"),
            "{missing}"
        );
        let missing = runner(Runtime::Node, "nowhere.handler")
            .check(&examples)
            .await
            .unwrap_err();
        assert!(
            missing.contains("Cannot find module 'nowhere'"),
            "{missing}"
        );
    }
}
