//! How a command that may create the lease table creates it (`consume`, `import-kcl`): billing,
//! tags and point-in-time recovery, spelled one way on every command.

use shardwise::ConfigError;
use shardwise::lease::{Billing, TableOptions};

use crate::flag_error::Source;

/// The lease table's flags.
#[derive(Debug, clap::Args)]
pub(crate) struct TableFlags {
    /// How the lease table is billed when this command creates it: on demand, or provisioned
    /// read and write capacity units.
    #[arg(long, env = "SHARDWISE_BILLING_MODE", value_name = "on-demand|provisioned:READ,WRITE", default_value = "on-demand", value_parser = parse_billing)]
    billing_mode: Billing,

    /// A tag of the lease table when this command creates it (repeat for more).
    #[arg(long = "tag", env = "SHARDWISE_TAG", value_name = "KEY=VALUE", value_parser = parse_tag)]
    tags: Vec<(String, String)>,

    /// Turn on point-in-time recovery (continuous backups) of the lease table, new or existing.
    #[arg(long, env = "SHARDWISE_POINT_IN_TIME_RECOVERY")]
    point_in_time_recovery: bool,
}

impl TableFlags {
    /// How a missing lease table is created.
    pub(crate) fn options(&self) -> TableOptions {
        let options = TableOptions::default()
            .billing(self.billing_mode)
            .point_in_time_recovery(self.point_in_time_recovery);
        self.tags
            .iter()
            .fold(options, |options, (key, value)| options.tag(key, value))
    }

    /// The value typed for the flag behind `err`, when it is one of these flags' settings.
    pub(crate) fn given(&self, err: &ConfigError) -> Option<String> {
        match err.field() {
            "billing" => Some(billing_name(self.billing_mode)),
            // The `--tag` whose key or value the library rejected (it names the rejected text).
            "tags" => self
                .tags
                .iter()
                .find(|(key, value)| {
                    format!("{key:?}") == err.value() || format!("{value:?}") == err.value()
                })
                .map(|(key, value)| format!("{key}={value}")),
            _ => None,
        }
    }

    /// The flag that sets a setting of [`TableOptions`].
    pub(crate) fn source_of(setting: &str) -> Option<Source> {
        match setting {
            "billing" => Some(Source::Flag("--billing-mode")),
            "tags" => Some(Source::Flag("--tag")),
            _ => None,
        }
    }
}

fn parse_billing(s: &str) -> Result<Billing, String> {
    if s == "on-demand" {
        return Ok(Billing::OnDemand);
    }
    let expected = || format!("`{s}`: expected on-demand or provisioned:READ,WRITE");
    let (read, write) = s
        .strip_prefix("provisioned:")
        .and_then(|units| units.split_once(','))
        .ok_or_else(expected)?;
    let units = |n: &str| {
        n.parse::<u64>()
            .map_err(|_| format!("`{n}` is not a number of capacity units"))
    };
    Ok(Billing::Provisioned {
        read: units(read)?,
        write: units(write)?,
    })
}

/// `--billing-mode` as the user spells it.
fn billing_name(billing: Billing) -> String {
    match billing {
        Billing::OnDemand => "on-demand".into(),
        Billing::Provisioned { read, write } => format!("provisioned:{read},{write}"),
        other => format!("{other:?}"),
    }
}

fn parse_tag(s: &str) -> Result<(String, String), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=VALUE"))?;
    Ok((key.to_owned(), value.to_owned()))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::flag_error::invalid_setting;

    #[derive(Debug, clap::Parser)]
    struct Command {
        #[command(flatten)]
        table: TableFlags,
    }

    fn flags(argv: &[&str]) -> TableFlags {
        Command::try_parse_from([&["cmd"], argv].concat())
            .expect("flags")
            .table
    }

    #[test]
    fn flags_become_table_options() {
        let plain = flags(&[]);
        assert_eq!(plain.options(), TableOptions::default());
        assert_eq!(billing_name(plain.billing_mode), "on-demand");
        let given = flags(&[
            "--billing-mode",
            "provisioned:7,3",
            "--tag",
            "team=billing",
            "--tag",
            "cost-centre=a=b",
            "--point-in-time-recovery",
        ]);
        assert_eq!(
            given.options(),
            TableOptions::default()
                .billing(Billing::Provisioned { read: 7, write: 3 })
                .tag("team", "billing")
                .tag("cost-centre", "a=b")
                .point_in_time_recovery(true)
        );
        assert_eq!(billing_name(given.billing_mode), "provisioned:7,3");
    }

    #[test]
    fn billing_modes_and_tags_are_spelled_one_way() {
        for bad in [
            "provisioned",
            "provisioned:5",
            "provisioned:a,5",
            "ondemand",
        ] {
            assert!(parse_billing(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_billing("provisioned:x,1"),
            Err("`x` is not a number of capacity units".into())
        );
        assert_eq!(parse_tag("k="), Ok(("k".into(), String::new())));
        assert_eq!(parse_tag("k"), Err("`k`: expected KEY=VALUE".into()));
    }

    #[test]
    fn options_the_library_refuses_name_the_flag_and_the_value_typed() {
        let cases = [
            (
                &["--billing-mode", "provisioned:0,5"][..],
                "invalid --billing-mode provisioned:0,5: provisioned read and write capacity \
                 must each be at least 1",
            ),
            (
                &["--tag", "team=orders", "--tag", "aws:owner=me"][..],
                "invalid --tag aws:owner=me: a tag key is 1 to 128 characters and does not start \
                 with `aws:`",
            ),
        ];
        for (argv, expected) in cases {
            let given = flags(argv);
            let err = given.options().validate().expect_err("refused");
            let message = invalid_setting(&err, given.given(&err), TableFlags::source_of);
            assert_eq!(message.to_string(), expected);
        }
    }
}
