/**
 * overmind-jupyter: the side panel of overmind_jupyter in JupyterLab's left area, and its summary in
 * the status bar. Settings (schema/panel.json): the refresh interval, and whether the status item shows.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Signal } from '@lumino/signaling';

import overmindSvg from '../style/icons/overmind.svg';
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
    const panel = new OvermindPanel({ model, serverSettings: app.serviceManager.serverSettings });
    panel.id = PANEL_ID;
    panel.title.icon = overmindIcon;
    panel.title.caption = 'Overmind: cached models';
    app.shell.add(panel, 'left', { rank: 650 });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
    }
    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Overmind Panel',
      caption: 'Models cached by the overmind daemon',
      execute: () => app.shell.activateById(PANEL_ID)
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.open, category: 'Overmind' });
    }

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
    model.wanted = () => panel.isVisible || showStatus;

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
