//! Write the seed corpus: `cargo run --bin seeds` (from `fuzz/`) fills
//! `corpus/<target>/seed-<name>` for every target (or only those named as arguments).

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    for target in tessera_fuzz::seeds::TARGETS {
        if !wanted.is_empty() && !wanted.iter().any(|w| w == target) {
            continue;
        }
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        let seeds = tessera_fuzz::seeds::for_target(target);
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
        }
        println!("{target}: {} seeds in {}", seeds.len(), dir.display());
    }
    Ok(())
}
