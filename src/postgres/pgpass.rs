//! The password file (`PGPASSFILE`, else `~/.pgpass`), read the way libpq
//! and sqlx read it: the first line whose host, port, database and user
//! match (`*` matches anything), with `\:` and `\\` escaped. sqlx applies it
//! to the pools; the replication connection needs the same password.

use std::path::PathBuf;

/// The password for these settings, if the file has one. A host that is a
/// Unix socket directory matches `localhost`, as in libpq.
pub fn find(host: &str, port: u16, database: &str, user: &str) -> Option<String> {
    let path = std::env::var_os("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")))?;
    let text = std::fs::read_to_string(path).ok()?;
    lookup(&text, host, port, database, user)
}

fn lookup(text: &str, host: &str, port: u16, database: &str, user: &str) -> Option<String> {
    let host = if host.starts_with('/') {
        "localhost"
    } else {
        host
    };
    let port = port.to_string();
    let want = [host, port.as_str(), database, user];
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|line| {
            let fields = split(line);
            let [h, p, d, u, password] = <[String; 5]>::try_from(fields).ok()?;
            let matches = [h, p, d, u]
                .iter()
                .zip(want)
                .all(|(field, want)| field == "*" || field == want);
            matches.then_some(password)
        })
}

/// A line's colon-separated fields, escapes undone.
fn split(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(next), Some(field)) = (chars.next(), fields.last_mut()) {
                    field.push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => {
                if let Some(field) = fields.last_mut() {
                    field.push(c);
                }
            }
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::lookup;

    #[test]
    fn the_first_matching_line_wins_with_wildcards_and_escapes() {
        let file = "# comment\n\
                    db.local:5432:app:bob:first\n\
                    *:*:app:bob:second\n\
                    localhost:6000:*:*:sock\\:et\n\
                    *:*:*:alice:pa\\\\ss:with:colons\n";
        assert_eq!(
            lookup(file, "db.local", 5432, "app", "bob").as_deref(),
            Some("first")
        );
        assert_eq!(
            lookup(file, "other", 1, "app", "bob").as_deref(),
            Some("second")
        );
        assert_eq!(
            lookup(file, "/run/pg", 6000, "x", "y").as_deref(),
            Some("sock:et")
        );
        assert_eq!(
            lookup(file, "h", 1, "d", "alice").as_deref(),
            Some("pa\\ss:with:colons")
        );
        assert_eq!(lookup(file, "h", 1, "d", "nobody"), None);
    }
}
