// `sqlx::migrate!` embeds migrations/ at compile time; a new or changed
// migration must rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
