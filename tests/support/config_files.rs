//! Configuration files the tests read, written once.

/// A `tollgate.toml` with policy `api` (`policy`: the lines of its table) and one rule `api`
/// applying it to every request together (the `global` key).
pub fn global_api(policy: &str) -> String {
    format!(
        "[policies.api]\n{policy}\n\n[[rules]]\nname = \"api\"\nkey = \"global\"\npolicy = \"api\"\n"
    )
}
