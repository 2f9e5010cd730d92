/**
 * overmind-jupyter: the side panel of overmind_jupyter in JupyterLab's left area, its summary in the
 * status bar, and its charts in main-area tabs (which a reload of the page opens again, as it does the
 * panel). Settings (schema/panel.json): the refresh interval, and whether the status item shows. The
 * views follow the notebook (or console) in focus in the main area.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import overmindSvg from '../style/icons/overmind.svg';
import { CHART_TITLES, ChartKind } from './charts';
import { chartTab, OvermindChartView } from './chartview';
import { DEFAULT_INTERVAL_S, OvermindModel } from './model';
import { OvermindPanel } from './panel';
import { OvermindStatus } from './statusbar';

export const overmindIcon = new LabIcon({
  name: 'overmind-jupyter:overmind',
  svgstr: overmindSvg
});

const PLUGIN_ID = 'overmind-jupyter:panel';
const PANEL_ID = 'overmind-panel';

namespace CommandIDs {
  export const open = 'overmind:open-panel';
  export const openChart = 'overmind:open-chart';
}

/** The session path of a main-area widget that has a kernel (a notebook, a console), else null. */
function sessionPath(widget: Widget | null): string | null {
  const session = (widget as { sessionContext?: { path?: unknown } } | null)?.sessionContext;
  return session && typeof session.path === 'string' && session.path ? session.path : null;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'The overmind side panel and status-bar item: models cached by the per-user daemon, GPU units, kernels and fallbacks.',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette, ISettingRegistry, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    registry: ISettingRegistry | null,
    statusBar: IStatusBar | null
  ) => {
    const model = new OvermindModel(app.serviceManager.serverSettings);
    // The charts' tabs, tracked so that a reload of the page opens them again where they were.
    const charts = new WidgetTracker<MainAreaWidget<OvermindChartView>>({ namespace: 'overmind-chart' });
    const openChart = (kind: ChartKind, activate = true): void => {
      let widget = charts.find(w => w.content.kind === kind);
      if (!widget) {
        widget = chartTab(model, kind, overmindIcon);
        void charts.add(widget);
        app.shell.add(widget, 'main', { mode: 'split-right' });
      }
      if (activate) {
        app.shell.activateById(widget.id);
      }
    };
    const panel = new OvermindPanel({
      model,
      serverSettings: app.serviceManager.serverSettings,
      openChart: kind => void app.commands.execute(CommandIDs.openChart, { chart: kind })
    });
    panel.id = PANEL_ID;
    panel.title.icon = overmindIcon;
    panel.title.caption = 'Overmind: cached models';
    app.shell.add(panel, 'left', { rank: 650 });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
      void restorer.restore(charts, {
        command: CommandIDs.openChart,
        args: widget => ({ chart: widget.content.kind, activate: false }),
        name: widget => widget.content.kind
      });
    }
    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Overmind Panel',
      caption: 'Models cached by the overmind daemon',
      execute: () => app.shell.activateById(PANEL_ID)
    });
    app.commands.addCommand(CommandIDs.openChart, {
      label: args => `Open Overmind: ${CHART_TITLES[(args.chart as ChartKind) ?? 'memory'] ?? args.chart}`,
      caption: 'A chart of the Overmind panel, larger, in a tab of its own',
      execute: args =>
        openChart(
          ((args.chart as ChartKind) in CHART_TITLES ? args.chart : 'memory') as ChartKind,
          args.activate !== false
        )
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.open, category: 'Overmind' });
      for (const chart of Object.keys(CHART_TITLES)) {
        palette.addItem({ command: CommandIDs.openChart, args: { chart }, category: 'Overmind' });
      }
    }

    // The focused notebook: the last main-area widget with a kernel (a chart's tab in focus keeps it).
    const follow = (): void => {
      const path = sessionPath(app.shell.currentWidget);
      if (path !== null) {
        model.focused = path;
      }
    };
    app.shell.currentChanged?.connect(follow);
    app.restored.then(follow).catch(() => undefined);

    let showStatus = statusBar !== null;
    const statusChanged = new Signal<OvermindPanel, void>(panel);
    if (statusBar) {
      const item = new OvermindStatus(model, () => app.shell.activateById(PANEL_ID));
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 50,
        isActive: () => showStatus,
        activeStateChanged: statusChanged
      });
    }
    model.wanted = () =>
      panel.isVisible || showStatus || charts.find(w => w.isVisible) !== undefined;

    if (registry) {
      const apply = (settings: ISettingRegistry.ISettings): void => {
        model.interval = (settings.get('refreshInterval').composite as number) ?? DEFAULT_INTERVAL_S;
        const show = statusBar !== null && (settings.get('showStatusItem').composite as boolean) !== false;
        if (show !== showStatus) {
          showStatus = show;
          statusChanged.emit();
          void model.refresh();
        }
      };
      registry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(apply);
        })
        .catch(reason => console.error(`overmind-jupyter: the settings did not load: ${reason}`));
    }
  }
};

export default plugin;
