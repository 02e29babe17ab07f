//! `shardwise receipts`: an application's receipt ledger; and, for an operator, settling or
//! releasing a held event, and starting the retention of a quarantined one.

use std::time::UNIX_EPOCH;

use anyhow::{Context, bail};
use serde::Serialize;
use shardwise::receipts::{
    Disposition, DynamoDbReceipts, EventId, Receipt, ReceiptStore, Recorded,
};

use crate::common::{Ctx, Result, print_json_lines, print_lines, table};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The application.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The receipt table (default: `APP-receipts`, as `consume --receipts` without a table).
    #[arg(long, value_name = "TABLE")]
    table: Option<String>,

    /// Only this event (its identity, as `consume` lines and the ledger show it, e.g.
    /// `kinesis/orders/shardId-000000000000/4959...0.0`).
    #[arg(long, value_name = "EVENT")]
    id: Option<String>,

    /// Release the held event: the worker holding it handles it again.
    #[arg(long, value_name = "EVENT", conflicts_with_all = ["id", "quarantine"])]
    release: Option<String>,

    /// Quarantine the held (or unknown) event for good, with --reason: the worker holding it
    /// settles it and the checkpoint passes it.
    #[arg(long, value_name = "EVENT", requires = "reason", conflicts_with = "id")]
    quarantine: Option<String>,

    /// Start the retention of the quarantined event's receipt (an operator is done with it): it
    /// is deleted once --retention has passed. Until then a quarantined receipt stays for good.
    #[arg(long, value_name = "EVENT", conflicts_with_all = ["id", "release", "quarantine"])]
    expire: Option<String>,

    /// With --expire: how long the receipt is kept from now, e.g. `7d`, `36h`. Longer than any
    /// replay of the event can come (read by timestamp: the close horizon plus the lateness).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, default_value = "7d", requires = "expire")]
    retention: std::time::Duration,

    /// Why (with --quarantine).
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,

    /// At most this many receipts.
    #[arg(long, value_name = "N", default_value_t = 1_000)]
    limit: usize,

    /// One JSON object per receipt, one per line.
    #[arg(long)]
    json: bool,
}

/// One receipt as `--json` prints it.
#[derive(Debug, Serialize)]
struct ReceiptJson<'a> {
    event: &'a str,
    disposition: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    recorded_ms: u128,
    by: &'a str,
}

impl<'a> ReceiptJson<'a> {
    fn of(r: &'a Receipt) -> Self {
        Self {
            event: r.event.as_str(),
            disposition: r.disposition.label(),
            reason: r.disposition.reason(),
            recorded_ms: r
                .recorded_at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            by: &r.by,
        }
    }
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let table_name = args
        .table
        .clone()
        .unwrap_or_else(|| format!("{}-receipts", args.app));
    let ledger = DynamoDbReceipts::new(ctx.dynamodb(), table_name.clone(), args.app.clone())
        .create_if_missing(false)
        .retention(args.retention);
    let context = || {
        format!(
            "cannot read the receipts of `{}` in `{table_name}`",
            args.app
        )
    };
    ledger.prepare().await.with_context(context)?;
    if let Some(event) = &args.release {
        if !ledger
            .release(&EventId::new(event))
            .await
            .with_context(context)?
        {
            bail!("`{event}` has no held receipt to release (it is unknown, or already terminal)");
        }
        return print_lines([format!("released {event}")]).map_err(Into::into);
    }
    if let Some(event) = &args.expire {
        if !ledger
            .start_retention(&EventId::new(event))
            .await
            .with_context(context)?
        {
            bail!(
                "`{event}` has no quarantined receipt (it is unknown, applied or held); nothing changed"
            );
        }
        let days = args.retention.as_secs_f64() / 86_400.0;
        return print_lines([format!(
            "{event}: its quarantined receipt expires in {days:.1} days"
        )])
        .map_err(Into::into);
    }
    if let Some(event) = &args.quarantine {
        let reason = args.reason.clone().unwrap_or_default();
        let disposition = Disposition::Quarantined(reason);
        return match ledger
            .record(&EventId::new(event), &disposition, "shardwise-cli")
            .await
            .with_context(context)?
        {
            Recorded::Recorded => print_lines([format!("quarantined {event}")]).map_err(Into::into),
            Recorded::Exists(r) => bail!(
                "`{event}` already has a terminal receipt ({}); it is left as it is",
                r.disposition.label()
            ),
            _ => Ok(()),
        };
    }
    let receipts = match &args.id {
        Some(event) => ledger
            .get(&EventId::new(event))
            .await
            .with_context(context)?
            .into_iter()
            .collect(),
        None => ledger.list(args.limit).await.with_context(context)?,
    };
    if args.json {
        print_json_lines(receipts.iter().map(ReceiptJson::of))?;
    } else {
        let rows: Vec<Vec<String>> = receipts
            .iter()
            .map(|r| {
                vec![
                    r.event.to_string(),
                    r.disposition.label().to_string(),
                    r.disposition.reason().unwrap_or("-").to_string(),
                    r.by.clone(),
                ]
            })
            .collect();
        print_lines(table(&["EVENT", "DISPOSITION", "REASON", "BY"], &rows))?;
    }
    Ok(())
}
