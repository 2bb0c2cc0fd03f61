//! Configuration files the tests read, written once.

/// A `tollgate.toml` with policy `api` (`policy`: the lines of its table) and one rule `api`
/// applying it to every request together (the `global` key).
pub fn global_api(policy: &str) -> String {
    format!(
        "[policies.api]\n{policy}\n\n[[rules]]\nname = \"api\"\nkey = \"global\"\npolicy = \"api\"\n"
    )
}

/// What the error of a refused file must be: `Is` its whole `Display`, or `At` a line, column
/// and field.
#[derive(Debug, Clone, Copy)]
pub enum Says {
    Is(&'static str),
    At(usize, usize, &'static str),
}

/// Reads each case's file as `tollgate.toml`, expecting it refused with the error it says;
/// panics at the first that is read, or refused otherwise.
#[cfg(feature = "config")]
#[track_caller]
pub fn refused<T: AsRef<str>>(cases: &[(T, Says)]) {
    for (text, says) in cases {
        let text = text.as_ref();
        let e = tollgate::config::LimitsConfig::from_toml(text, "tollgate.toml")
            .expect_err("the file should be refused");
        match *says {
            Says::Is(display) => assert_eq!(e.to_string(), display, "{text}"),
            Says::At(line, column, field) => {
                let place = (e.line(), e.column(), e.field());
                assert_eq!(place, (Some(line), Some(column), Some(field)), "{text}");
            }
        }
    }
}
