//! Every scenario file shipped parses, is named after its file, and has a name of its own.

use std::{collections::BTreeSet, path::Path};

use retry_after_eval::scenario::Scenario;

#[test]
fn every_shipped_scenario_parses_and_is_named_after_its_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut names = BTreeSet::new();
    let mut count = 0;
    for dir in [root.clone(), root.join("suite")] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|x| x != "toml") {
                continue;
            }
            let scenario = Scenario::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
            let stem = path.file_stem().unwrap().to_string_lossy();
            assert_eq!(scenario.name, stem, "{}", path.display());
            assert!(
                names.insert(scenario.name.clone()),
                "{} twice",
                scenario.name
            );
            count += 1;
        }
    }
    assert_eq!(count, 31, "5 scenarios and a suite of 26");
}
